"""End to end on a tiny model through the in-process engine (LocalGenerator): difficulty-filter a
generated set, collect SFT traces from a run directory and build an SFT batch, evaluate with the
eval CLI (JSON + Markdown + PNG).

The model (tests/data/tinylm.py) answers ``<think>hm</think>\\boxed{4}`` with probability 0.75 and
``...\\boxed{5}`` otherwise, whatever the question, so a problem whose reference is 4 is solved
about 3 times in 4, one whose reference is 5 about once in 4 -- with most samples agreeing on 4, the
mark of a wrong reference -- and one whose reference is 7 never.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.cli import main as cli_main
from megatron_rl.data.difficulty import difficulty_filter
from megatron_rl.data.problems import Problem, read_problems, write_problems
from megatron_rl.data.rundir import Sample, SampleWriter
from megatron_rl.data.sampling import SamplingConfig, load_tokenizer, sample_and_score
from megatron_rl.data.sft import read_sft_pairs
from megatron_rl.evaluation.metrics import pass_at_k
from megatron_rl.generation.api import LocalGenerator
from megatron_rl.rewards.compose import RewardConfig


def curate(argv: list[str]) -> int:
    """``megatron-rl curate ...`` in this process, behind the console script's error path."""
    return cli_main(["curate", *argv])


def evaluate(argv: list[str]) -> int:
    """``megatron-rl eval ...`` in this process, behind the console script's error path."""
    return cli_main(["eval", *argv])


PNG = b"\x89PNG\r\n\x1a\n"
SET = [
    Problem(id="four", problem="What is 2 + 2?", answer="4"),
    Problem(id="five", problem="What is 2 + 3?", answer="5"),
    Problem(id="seven", problem="What is 3 + 4?", answer="7"),
]


@pytest.fixture(scope="module")
def sampled(answering_folder, pool):
    tok = load_tokenizer(answering_folder)
    gen = LocalGenerator.from_pretrained(answering_folder, max_slots=16, max_len=1024)
    attempts = sample_and_score(
        SET,
        gen,
        tok,
        SamplingConfig(k=32, max_new_tokens=24, seed=0),
        RewardConfig(),
        pool=pool,
        progress=False,
        keep_tokens=True,
    )
    return tok, attempts


def test_difficulty_filter_through_the_engine(sampled, pool, answering_folder, tmp_path):
    _, attempts = sampled
    for p in SET:
        for a in attempts[p.id]:
            assert a.completion in ("<think>hm</think>\\boxed{4}", "<think>hm</think>\\boxed{5}")
            assert a.correct == (a.answer == p.answer) and a.finish_reason == "stop"
    rates = {pid: sum(a.correct for a in tries) / 32 for pid, tries in attempts.items()}
    assert 0.5 < rates["four"] < 0.95 and 0.05 < rates["five"] < 0.5 and rates["seven"] == 0
    kept, details, report = difficulty_filter(SET, attempts, pool=pool, progress=False)
    d = {x.problem_id: x for x in details}
    assert [p.id for p in kept] == ["four"] and kept[0].meta["pass_rate"] == rates["four"]
    for pid in ("five", "seven"):  # most samples say 4: the reference is suspect
        assert d[pid].flagged and d[pid].majority_answer == "4"
        assert d[pid].decision == "likely_wrong_reference"
    assert report.dropped == {"likely_wrong_reference": 2}
    # The same through `megatron-rl curate difficulty --model`: same seeds, same verdicts.
    write_problems(tmp_path / "set.jsonl", SET)
    out = tmp_path / "kept.jsonl"
    assert (
        curate(
            [
                "difficulty",
                "--input",
                str(tmp_path / "set.jsonl"),
                "--output",
                str(out),
                "--model",
                answering_folder,
                "--k",
                "32",
                "--max-new-tokens",
                "24",
                "--quiet",
            ]
        )
        == 0
    )
    assert [p.id for p in read_problems(out)] == ["four"]
    cli = [json.loads(x) for x in (tmp_path / "kept.difficulty.jsonl").read_text().splitlines()]
    assert [x["pass_rate"] for x in cli] == [d[p.id].pass_rate for p in SET]
    assert (tmp_path / "kept.pass_rate.png").read_bytes()[:8] == PNG


def test_sft_traces_from_a_run_directory_to_a_batch(sampled, tmp_path):
    tok, attempts = sampled
    run = tmp_path / "run"
    with SampleWriter(run) as w:  # what the RL loop would have written, one step per 8 samples
        for p in SET:
            for a in attempts[p.id]:
                w.write(
                    Sample(
                        step=a.index // 8,
                        prompt_id=p.id,
                        problem=p.problem,
                        task="math",
                        prompt_ids=a.prompt_ids,
                        completion_ids=a.completion_ids,
                        completion=a.completion,
                        reward=a.reward,
                        parts=a.parts,
                        reason=a.reason,
                        correct=a.correct,
                        versions=[a.index // 8] * len(a.completion_ids),
                    )
                )
    out = tmp_path / "sft.jsonl"
    assert curate(["sft-traces", "--run", str(run), "--output", str(out), "--min-step", "1", "--quiet"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    # Correct completions only: one distinct trace each for "four" and "five", none for "seven";
    # "five" (pass rate ~0.25 from step 1 on) is upsampled by ceil(0.5 / rate).
    assert {r["prompt_id"] for r in rows} == {"four", "five"}
    rate = sum(a.correct for a in attempts["five"][8:]) / 24
    assert Counter(r["prompt_id"] for r in rows) == {"four": 1, "five": min(4, math.ceil(0.5 / rate))}
    batch = build_sft_batch(read_sft_pairs(str(out)))
    seq = next(s for s, r in zip(batch.sequences, rows) if r["prompt_id"] == "five")
    assert tok.decode(seq.tokens[seq.prompt_length :].tolist()) == "<think>hm</think>\\boxed{5}</s>"
    assert tok.decode(seq.tokens[: seq.prompt_length].tolist()).endswith("<|assistant|>")
    assert sum(s.weight * s.completion_length for s in batch.sequences) == pytest.approx(1.0)


def test_eval_cli_writes_json_markdown_and_plots(answering_folder, tmp_path, capsys):
    data = tmp_path / "eval.jsonl"
    write_problems(
        data,
        [
            Problem(id="four", problem="What is 2 + 2?", answer="4", lang="en"),
            Problem(id="four@fr", problem="Combien font 2 + 2 ?", answer="4", lang="fr"),
            Problem(id="five", problem="What is 2 + 3?", answer="5", lang="en"),
        ],
    )
    out = tmp_path / "report"
    assert (
        evaluate(
            [
                "--model",
                answering_folder,
                "--data",
                str(data),
                "--k",
                "8",
                "--max-new-tokens",
                "24",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 24
    by = {}
    for s in samples:
        by.setdefault(s["problem_id"], []).append(s)
    problems = {p["problem_id"]: p for p in report["problems"]}
    for pid, tries in by.items():
        c = sum(s["correct"] for s in tries)
        for k in (1, 2, 4, 8):  # the unbiased estimator on the counts the samples show
            assert problems[pid]["pass_at"][str(k)] == pytest.approx(pass_at_k(8, c, k))
        votes = Counter(s["answer"] for s in tries).most_common()
        leaders = [a for a, n in votes if n == votes[0][1]]
        ref = "4" if pid.startswith("four") else "5"
        assert problems[pid]["maj"] == pytest.approx((ref in leaders) / len(leaders))
    overall = report["summary"]["overall"]
    assert overall["pass_at"]["1"] == pytest.approx(sum(s["correct"] for s in samples) / 24)
    assert set(report["summary"]["by_lang"]) == {"en", "fr"}
    assert report["summary"]["by_lang"]["fr"]["problems"] == 1
    assert overall["length"]["all"]["mean"] > 0 and overall["truncated_share"] == 0
    md = (out / "report.md").read_text()
    assert "| all | 3 |" in md and "## Per language" in md and "| fr | 1 |" in md
    for name in ("pass_at_k.png", "lengths.png", "languages.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert "eval: 3 problems x 8 samples: pass@1" in capsys.readouterr().out


@pytest.mark.fault("input")
def test_eval_cli_bad_input(answering_folder, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"problem": "x", "answer": "1"}\n{"problem": 3}\n')
    assert (
        evaluate(["--model", answering_folder, "--data", str(data), "--out", str(tmp_path / "o")]) == 3
    )  # a bad input file
    assert f"{data}:2: problem" in capsys.readouterr().err
    assert evaluate(["--servers", "http://localhost:1", "--data", str(data), "--out", "o"]) == 3
    good = tmp_path / "good.jsonl"
    good.write_text('{"problem": "x", "answer": "1"}\n')
    assert (
        evaluate(["--model", str(tmp_path / "none"), "--data", str(good), "--out", "o"]) == 3
    )  # no tokenizer folder
    assert "none: no such tokenizer folder" in capsys.readouterr().err
