"""Every case of the new-user audit of bad inputs, run again as the user ran it (the real console
command, a process of its own): one line on stderr, a non-zero exit of the mistake's kind, no
traceback, and every input byte unchanged (sha256 before and after). The few cases that were
*refused* but should be *accepted* (a byte-order mark, records without a language) exit 0.

The convert and serve-engine cases of the same audit are in tests/convert/test_refusals.py and
tests/generation/test_server_hostile.py; the generated cases of every verb in test_cli_fuzz.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.errors import EXIT_INPUT, EXIT_OUTPUT, EXIT_USAGE

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"problem": "What is 2+2?", "answer": "4", "completion": "<think>2+2</think> \\boxed{4}"}
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}' if i > 1 else '*a'] * 9)}]\n" for i in range(1, 12)
)

pytestmark = [pytest.mark.fault("input"), pytest.mark.slow]


def _write(d: Path, files: dict[str, bytes | str]) -> list[Path]:
    out = []
    for name, content in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        out.append(p)
    return out


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # A generous bound that only a hang reaches (a billion-laughs recipe used to run past it).
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _digest(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


LINE = json.dumps(GOOD) + "\n"
CASES = {
    # name: (files, argv, exit code, words the one line must hold)
    "non-UTF-8 recipe": (
        {"r.yaml": b"loop:\n  group_size: \xff\xfe\n"},
        ["config", "r.yaml"],
        EXIT_USAGE,
        ["r.yaml:2", "UTF-8"],
    ),
    "self-referencing anchor": (
        {"r.yaml": "a: &a [*a]\n"},
        ["config", "r.yaml"],
        EXIT_USAGE,
        ["r.yaml:1", "alias"],
    ),
    "billion laughs": ({"r.yaml": LAUGHS}, ["config", "r.yaml"], EXIT_USAGE, ["r.yaml", "aliases expand"]),
    "duplicate keys": (
        {"r.yaml": "loop:\n  seed: 1\n  seed: 2\n"},
        ["config", "r.yaml"],
        EXIT_USAGE,
        ["r.yaml:3", "duplicate key 'seed'"],
    ),
    "null section": (
        {"r.yaml": "algorithm:\n"},
        ["config", "r.yaml"],
        EXIT_USAGE,
        ["r.yaml:1", "algorithm", "null"],
    ),
    "huge integer": (
        {"r.yaml": "loop:\n  seed: " + "9" * 40 + "\n"},
        ["config", "r.yaml"],
        EXIT_USAGE,
        ["r.yaml:2", "2^63"],
    ),
    "deeply nested JSON line": (
        {"in.jsonl": '{"a": ' + "[" * 5000 + "]" * 5000 + "}\n"},
        ["reward", "--input", "in.jsonl", "--output", "out.jsonl", "--quiet"],
        EXIT_INPUT,
        ["in.jsonl:1", "nested deeper"],
    ),
    "literal NaN": (
        {"in.jsonl": '{"problem": "x", "answer": NaN, "completion": "y"}\n'},
        ["reward", "--input", "in.jsonl", "--output", "out.jsonl", "--quiet"],
        EXIT_INPUT,
        ["in.jsonl:1", "NaN"],
    ),
    "empty input file": (
        {"in.jsonl": ""},
        ["reward", "--input", "in.jsonl", "--output", "out.jsonl"],
        EXIT_INPUT,
        ["in.jsonl", "no records"],
    ),
    "--workers 0": (
        {"in.jsonl": LINE},
        ["reward", "--input", "in.jsonl", "--output", "o.jsonl", "--workers", "0"],
        EXIT_USAGE,
        ["--workers"],
    ),
    "missing --tokenizer": (
        {"in.jsonl": LINE},
        ["reward", "--input", "in.jsonl", "--output", "o.jsonl", "--tokenizer", "nope"],
        EXIT_INPUT,
        ["nope", "tokenizer"],
    ),
    "a --tokenizer that is no tokenizer": (
        {"in.jsonl": LINE, "notok/readme.txt": "hello"},
        ["reward", "--input", "in.jsonl", "--output", "o.jsonl", "--tokenizer", "notok"],
        EXIT_INPUT,
        ["notok", "not a Hugging Face tokenizer folder"],
    ),
    "reward --output is --input": (
        {"in.jsonl": LINE},
        ["reward", "--input", "in.jsonl", "--output", "in.jsonl"],
        EXIT_OUTPUT,
        ["--output in.jsonl is the input"],
    ),
    "missing translator module": (
        {"m.jsonl": json.dumps({"problem": "2+2?", "answer": "4", "translate_to": "fr"}) + "\n"},
        [
            "curate",
            "translate",
            "--input",
            "m.jsonl",
            "--output",
            "t.jsonl",
            "--translator",
            "no_such_mod:fn",
        ],
        EXIT_USAGE,
        ["--translator", "no_such_mod"],
    ),
    "curate --output is --input": (
        {"p.jsonl": json.dumps({"problem": "2+2?", "answer": "4"}) + "\n"},
        ["curate", "translate-mark", "--input", "p.jsonl", "--output", "p.jsonl", "--languages", "fr"],
        EXIT_OUTPUT,
        ["is the input"],
    ),
    "eval --out holds the data": (
        {"ev/samples.jsonl": json.dumps({"problem": "2+2?", "answer": "4"}) + "\n"},
        ["eval", "--data", "ev/samples.jsonl", "--out", "ev", "--model", "m"],
        EXIT_OUTPUT,
        ["ev/samples.jsonl is the input"],
    ),
    "quickstart --out names a file": (
        {"afile": "x"},
        ["quickstart", "--out", "afile"],
        EXIT_OUTPUT,
        ["--out", "afile", "is a file"],
    ),
    "quickstart bad override": (
        {},
        ["quickstart", "--out", "qs", "loop.group_size=-3"],
        EXIT_USAGE,
        ["loop.group_size"],
    ),
    "quickstart bad recipe": (
        {"r.yaml": "loop:\n  group_size: 4\n  group_size: 8\n"},
        ["quickstart", "--out", "qs", "--recipe", "r.yaml"],
        EXIT_USAGE,
        ["r.yaml:3", "duplicate key"],
    ),
    "local servers beyond the machine": (
        {"model/config.json": "{}"},
        ["train", "--no-progress", "model.hf=model", "fleet.local_servers=100000"],
        EXIT_USAGE,
        ["fleet.local_servers", "per core"],
    ),
    "argument of the wrong type": (
        {},
        ["reward", "--input", "x", "--output", "y", "--workers", "two"],
        EXIT_USAGE,
        ["--workers", "must be an integer", "'two'"],
    ),
    # -- the audit of main 9b06f20 (issue 49) ----------------------------------------------------
    "--port-file over the model's config.json": (
        {"m/config.json": "{}"},
        ["serve-engine", "--model", "m", "--port", "0", "--port-file", "m/config.json"],
        EXIT_OUTPUT,
        ["--port-file m/config.json lies inside the input m"],
    ),
    "--port-file over a file that is not a port file": (
        {"m/config.json": "{}", "notes.txt": "my notes\n"},
        ["serve-engine", "--model", "m", "--port", "0", "--port-file", "notes.txt"],
        EXIT_OUTPUT,
        ["--port-file notes.txt", "not a port file"],
    ),
    "fleet.urls naming no server": (
        {"model/config.json": "{}", "p.jsonl": json.dumps({"problem": "2+2?", "answer": "4"}) + "\n"},
        ["train", "--no-progress", "model.hf=model", "data.train=p.jsonl", "fleet.urls=[http://127.0.0.1:9]"],
        EXIT_USAGE,
        ["fleet.urls[0]", "http://127.0.0.1:9", "nothing answers"],
    ),
    "a lone surrogate in a reward record": (
        {"in.jsonl": '{"problem": "x", "answer": "4", "completion": "\\boxed{4} \\ud800"}\n'},
        ["reward", "--input", "in.jsonl", "--output", "out.jsonl", "--quiet"],
        EXIT_INPUT,
        ["in.jsonl:1", "'completion'", "lone UTF-16 surrogate", "\\ud800"],
    ),
    "bench collation --sequences -5": (
        {},
        ["bench", "collation", "--sequences", "-5"],
        EXIT_USAGE,
        ["--sequences", "-5"],
    ),
    "bench collation --budget 0": ({}, ["bench", "collation", "--budget", "0"], EXIT_USAGE, ["--budget"]),
    "eval --limit -1": (
        {"p.jsonl": json.dumps({"problem": "2+2?", "answer": "4"}) + "\n"},
        ["eval", "--data", "p.jsonl", "--out", "ev", "--model", "m", "--limit", "-1"],
        EXIT_USAGE,
        ["--limit", "must be an integer >= 1, got -1"],
    ),
    "config fleet.urls=[not a url]": (
        {},
        ["config", "fleet.urls=[not a url]"],
        EXIT_USAGE,
        ["fleet.urls[0]", "'not a url'", "not a server URL"],
    ),
    "NaN in a model's config.json (convert)": (
        {"m/config.json": '{"model_type": "llama",\n "rms_norm_eps": NaN}'},
        ["convert", "hf-to-mcore", "--hf", "m", "--out", "o"],
        EXIT_INPUT,
        ["m/config.json:2", "NaN", "'rms_norm_eps'"],
    ),
    "NaN in a model's config.json (serve-engine)": (
        {"m/config.json": '{"model_type": "llama",\n "rope_theta": Infinity}'},
        ["serve-engine", "--model", "m", "--port", "0"],
        EXIT_INPUT,
        ["m/config.json:2", "Infinity", "'rope_theta'"],
    ),
    "an empty language in translate-mark": (
        {"p.jsonl": json.dumps({"problem": "2+2?", "answer": "4"}) + "\n"},
        ["curate", "translate-mark", "--input", "p.jsonl", "--output", "m.jsonl", "--languages", "fr,,de"],
        EXIT_USAGE,
        ["--languages", "item 2 of 'fr,,de' is empty"],
    ),
    "a truncated Parquet file as data.eval": (
        {
            "model/config.json": "{}",
            "p.jsonl": json.dumps({"problem": "2+2?", "answer": "4"}) + "\n",
            "e.parquet": b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00",
        },
        ["train", "--no-progress", "model.hf=model", "data.train=p.jsonl", "data.eval=e.parquet"],
        EXIT_INPUT,
        ["e.parquet", "not a readable Parquet file"],
    ),
    "a CSV problem file that is not UTF-8": (
        {"model/config.json": "{}", "p.csv": b'problem,answer\n"x\xff",1\n'},
        ["train", "--no-progress", "model.hf=model", "data.train=p.csv"],
        EXIT_INPUT,
        ["p.csv", "not UTF-8"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_audit_case_is_one_line_and_keeps_the_input(tmp_path, name):
    files, argv, code, words = CASES[name]
    if argv[0] == "train":
        argv = ["train", str(ROOT / "examples" / "quickstart.yaml"), *argv[1:]]
    inputs = _write(tmp_path, files)
    before = _digest(inputs)
    tree_before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = _run(argv, tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("megatron-rl "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert _digest(inputs) == before
    assert not (tmp_path / "qs" / "warmup").exists()  # nothing long started
    # Nothing written: the tree holds exactly the inputs it held before.
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == tree_before


def test_a_byte_order_mark_is_accepted_in_a_recipe_and_in_jsonl(tmp_path):
    _write(
        tmp_path,
        {"r.yaml": b"\xef\xbb\xbfloop:\n  group_size: 8\n", "in.jsonl": b"\xef\xbb\xbf" + LINE.encode()},
    )
    proc = _run(["config", "r.yaml"], tmp_path)
    assert proc.returncode == 0 and "group_size: 8" in proc.stdout, proc.stderr
    proc = _run(
        ["reward", "--input", "in.jsonl", "--output", "out.jsonl", "--quiet", "--workers", "1"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["reason"] == "ok"


def test_translate_mark_detects_the_language_of_records_without_one(tmp_path):
    rows = [
        {"problem": "What is two plus two?", "answer": "4"},
        {"problem": "Combien font deux plus deux ?", "answer": "4"},
    ]
    _write(tmp_path, {"p.jsonl": "".join(json.dumps(r) + "\n" for r in rows)})
    argv = [
        "curate",
        "translate-mark",
        "--input",
        "p.jsonl",
        "--output",
        "m.jsonl",
        "--languages",
        "fr",
        "--fraction",
        "1",
    ]
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    marked = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # The English statement is marked for French; the French one is already in the only target.
    assert marked[0].get("translate_to") == "fr" and "translate_to" not in marked[1]
    report = json.loads((tmp_path / "m.report.json").read_text())
    assert "no lang field: detected fr" in json.dumps(report)
