"""``megatron-rl curate`` tools through their main(): outputs, the report on stderr and on disk,
and one-line errors for bad input."""

from __future__ import annotations

import json

from megatron_rl.cli import main as cli_main
from megatron_rl.data.benchmarks import sample_file
from megatron_rl.data.problems import read_problems
from megatron_rl.data.rundir import SampleWriter
from tests.data.test_sft import run_samples


def main(argv: list[str]) -> int:
    """``megatron-rl curate ...`` in this process, behind the console script's error path (one
    line on stderr and the exit code of the mistake's kind)."""
    return cli_main(["curate", *argv])


def test_math_format(tmp_path, capsys):
    out = tmp_path / "formatted.jsonl"
    assert (
        main(["math-format", "--input", str(sample_file("math_raw.jsonl")), "--output", str(out), "--quiet"])
        == 0
    )
    assert len(read_problems(out)) == 5
    report = json.loads((tmp_path / "formatted.report.json").read_text())
    assert report["kept"] == 5 and report["dropped"]["proof"] == 2
    err = capsys.readouterr().err
    assert "curate math-format: 15 in, kept 5, dropped 10" in err and "multi_part" in err


def test_bad_input_is_one_line_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"answer": "3"}\n')
    assert (
        main(["math-format", "--input", str(bad), "--output", str(tmp_path / "o.jsonl")]) == 3
    )  # a bad input file
    assert (
        capsys.readouterr().err.strip()
        == f"megatron-rl curate math-format: {bad}:2: problem: missing or not a non-empty string"
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_difficulty_from_scored_completions(tmp_path, capsys):
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        "".join(
            json.dumps(x) + "\n"
            for x in [
                {"id": "a", "problem": "2+2?", "answer": "4"},
                {"id": "b", "problem": "2+3?", "answer": "6"},
                {"id": "c", "problem": "1+1?", "answer": "2"},
            ]
        )
    )
    scored = []
    for pid, answers, ref in (("a", "4434", "4"), ("b", "5556", "6"), ("c", "2222", "2")):
        for x in answers:
            scored.append(
                {"problem_id": pid, "completion": f"<think>t</think>\\boxed{{{x}}}", "correct": x == ref}
            )
    (tmp_path / "scored.jsonl").write_text("".join(json.dumps(x) + "\n" for x in scored))
    out = tmp_path / "kept.jsonl"
    assert (
        main(
            [
                "difficulty",
                "--input",
                str(problems),
                "--output",
                str(out),
                "--scored",
                str(tmp_path / "scored.jsonl"),
                "--quiet",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert [p.id for p in read_problems(out)] == ["a"]
    flagged = [json.loads(x) for x in (tmp_path / "kept.flagged.jsonl").read_text().splitlines()]
    assert [(f["id"], f["majority_answer"], f["majority_count"]) for f in flagged] == [("b", "5", 3)]
    details = (tmp_path / "kept.difficulty.jsonl").read_text().splitlines()
    assert [json.loads(x)["decision"] for x in details] == ["kept", "likely_wrong_reference", "always_solved"]
    assert (tmp_path / "kept.pass_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "likely_wrong_reference" in capsys.readouterr().err


def test_translate_mark_and_translate(tmp_path):
    marked = tmp_path / "marked.jsonl"
    assert (
        main(
            [
                "translate-mark",
                "--input",
                str(sample_file("aime_sample.jsonl")),
                "--output",
                str(marked),
                "--fraction",
                "1",
                "--languages",
                "fr",
                "--quiet",
            ]
        )
        == 0
    )
    assert all(p.meta["translate_to"] == "fr" for p in read_problems(marked))
    out = tmp_path / "translated.jsonl"
    assert (
        main(
            [
                "translate",
                "--input",
                str(marked),
                "--output",
                str(out),
                "--translator",
                "tests.data.translators:word_for_word",
                "--quiet",
            ]
        )
        == 0
    )
    got = read_problems(out)
    assert len(got) == 8 and got[4].id == "made-up-2024-1@fr" and got[4].lang == "fr"


def test_sft_traces(tmp_path, random_folder):
    with SampleWriter(tmp_path / "run") as w:
        w.write_many(run_samples())
    out = tmp_path / "sft.jsonl"
    assert (
        main(
            [
                "sft-traces",
                "--run",
                str(tmp_path / "run"),
                "--output",
                str(out),
                "--min-step",
                "2",
                "--general",
                str(sample_file("general_chat.jsonl")),
                "--general-share",
                "0.2",
                "--tokenizer",
                random_folder,
                "--quiet",
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sum(r["source"] == "general" for r in rows) == 3  # 0.2 / 0.8 * 12 traces
    assert (
        main(
            [
                "sft-traces",
                "--run",
                str(tmp_path / "run"),
                "--output",
                str(out),
                "--general",
                str(sample_file("general_chat.jsonl")),
            ]
        )
        == 2
    )  # needs --tokenizer
