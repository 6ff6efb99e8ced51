"""A custom reward from a module outside the package drives a real ``megatron-rl train`` run: the
problems carry no reference answer (the custom reward replaces the check) and an extra field the
reward reads; a reward that raises and one that hangs score their samples 0 with the reason, and
the run goes on to the end."""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

REWARD = '''
import time

from megatron_rl.rewards.format import last_boxed


def score(completion, problem):
    """1 when the boxed answer is the record's own ``expect`` field; some records misbehave."""
    if problem["kind"] == "raise":
        raise ValueError("no expectation for this one")
    if problem["kind"] == "hang":
        time.sleep(3600)
    return {"score": float(last_boxed(completion) == str(problem["expect"])), "reason": "checked"}
'''


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_a_custom_reward_trains_and_its_failures_score_zero(tmp_path):
    from tests.data.tinylm import answering_model, tiny_train_command

    answering_model(tmp_path / "model")  # writes \boxed{4} three times in four, else \boxed{5}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_reward.py").write_text(REWARD)
    kinds = ["ok"] * 8 + ["raise", "hang"]
    rows = [
        {"id": f"q{i}", "problem": f"What is {i} + {4 - i}?", "expect": 4 if i % 2 else 5, "kind": kind}
        for i, kind in enumerate(kinds)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cmd = tiny_train_command(
        tmp_path / "model",
        run,
        3,
        f"data.train={train}",
        "data.eval=",
        "reward.custom=my_reward:score",
        "reward.custom_timeout_s=1",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "mine"), str(ROOT)])}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 3
    reasons: dict[str, set[str]] = defaultdict(set)
    for line in (run / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        kind = kinds[int(s["prompt_id"].split("@")[0][1:])]
        reasons[kind].add(s["reason"])
        assert "custom" in s["parts"] and "correct" not in s["parts"]
        if kind != "ok":
            assert s["parts"]["custom"] == 0.0, s
    assert reasons["raise"] == {"verifier_error"} and reasons["hang"] == {"timeout"}, dict(reasons)
    assert reasons["ok"] <= {"checked", "format_error"} and "checked" in reasons["ok"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/custom" in m for m in metrics)
