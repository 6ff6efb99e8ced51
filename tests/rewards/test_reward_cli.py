"""``megatron-rl reward`` end to end in a subprocess, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THINK = "<think>We add the two numbers together, which gives the total.</think>"
LINES = [
    {
        "problem": "What is two plus three?",
        "completion": THINK + "The sum is $\\boxed{5}$.",
        "answer": "5",
        "group_id": "g1",
    },
    {
        "problem": "What is two plus three?",
        "completion": THINK + "The sum is $\\boxed{6}$.",
        "answer": "5",
        "group_id": "g1",
        "num_tokens": 30000,
    },
    {
        "problem": "Print the sum of two integers.",
        "completion": THINK + "Sum them.\n```python\nprint(sum(map(int, input().split())))\n```",
        "tests": [{"input": "2 3\n", "output": "5\n"}],
        "language": "python",
    },
    {"problem": "What is two plus three?", "completion": "no thinking at all \\boxed{5}", "answer": "5"},
    {
        "problem": "Print the sum of two integers.",
        "language": "cpp",
        "tests": [{"input": "2 3\n", "output": "5\n"}],
        "completion": THINK
        + "Sum them.\n```cpp\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}\n```",
    },
]


def run(tmp_path, lines, *extra, raw=None, keep_input=False):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    if not keep_input:
        inp.write_text(raw if raw is not None else "".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "reward",
            "--input",
            str(inp),
            "--output",
            str(out),
            "--workers",
            "2",
            "--quiet",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return proc, out


def test_scores_in_input_order_with_parts_and_reasons(tmp_path):
    proc, out = run(tmp_path, LINES)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["reason"] for r in rows] == ["ok", "wrong_answer", "ok", "format_error", "ok"]
    assert [round(r["reward"], 4) for r in rows] == [1.1, 0.1, 1.1, 0.0, 1.1]
    assert rows[1]["parts"]["length"] == -0.1  # 30000 tokens > l_max (24576)
    assert rows[0]["group_id"] == "g1"  # input fields are kept
    assert "mean reward" in proc.stderr


@pytest.mark.fault("input")
def test_bad_line_is_an_error_naming_the_line(tmp_path):
    raw = json.dumps(LINES[0]) + "\n" + json.dumps({"problem": "x", "completion": "y"}) + "\n{not json\n"
    proc, out = run(tmp_path, None, raw=raw)
    assert proc.returncode != 0 and "in.jsonl:2:" in proc.stderr and "answer" in proc.stderr
    assert not out.exists()  # nothing half-written
    assert not list(tmp_path.glob(".out.jsonl.tmp*"))


@pytest.mark.fault("input")
def test_skip_bad_reports_each_bad_line_and_writes_exactly_the_good_ones(tmp_path):
    good = [LINES[0], {**LINES[1], "group_id": "g2"}, LINES[0]]
    raw = (
        b"{not json\n"
        + json.dumps(good[0]).encode()
        + b"\n\xff\xfe not utf-8\n\n"
        + json.dumps({**LINES[2], "language": "rust"}).encode()
        + b"\n"
        + json.dumps(good[1]).encode()
        + b"\n[1, 2]\n"
        + json.dumps({"problem": "p", "completion": "c"}).encode()
        + b"\n"
        + json.dumps(good[2]).encode()
        + b"\n"
    )
    (tmp_path / "in.jsonl").write_bytes(raw)
    proc, out = run(tmp_path, None, "--skip-bad", raw=None, keep_input=True)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [{k: r[k] for k in g} for r, g in zip(rows, good)] == good and len(rows) == 3
    for line, why in (
        (1, "invalid JSON"),
        (3, "not UTF-8"),
        (5, "language"),
        (7, "expected a JSON object"),
        (8, "answer"),
    ):
        assert (
            f"in.jsonl:{line}:" in proc.stderr
            and why in proc.stderr.split(f"in.jsonl:{line}:")[1].split("\n")[0]
        )
    assert "5 bad lines skipped" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.fault("input")
def test_unwritable_output_is_one_clear_line(tmp_path):
    (tmp_path / "ro").write_text("a file, so no folder can be made under it (root ignores modes)")
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(LINES[0]) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "reward",
            "--input",
            str(inp),
            "--output",
            str(tmp_path / "ro" / "sub" / "out.jsonl"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode != 0 and "cannot write" in proc.stderr and "Traceback" not in proc.stderr


def test_overrides_reach_the_reward(tmp_path):
    proc, out = run(tmp_path, LINES[:1], "reward.format_reward=0.2", "reward.language_reward=0")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["reward"] == 1.1  # 0.2 + 0.9 + 0
