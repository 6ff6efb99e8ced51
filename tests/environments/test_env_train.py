"""A real ``megatron-rl train`` run with a multi-turn environment from a module outside the
package: the built-in engine server over HTTP, each model turn a request of the trajectory's ids.
Environments that raise, hang past ``env.step_timeout_s`` or return a non-list end their
trajectories, each counted by reason; the run ends on its own with exit 0, and what it trains
is the sampled ids and the rendered deltas, environment tokens masked."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ENV = '''
import time


class Checker:
    """Answers the first turn with a check of the boxed answer; misbehaves as the record says."""

    def __init__(self, greeting="Check your answer."):
        self.greeting = greeting
        self.turn = 0

    def reset(self, problem):
        self.kind = problem["kind"]
        return [{"role": "user", "content": problem["problem"] + " " + self.greeting}]

    def step(self, text):
        self.turn += 1
        if self.kind == "raise":
            raise ValueError("the checker broke")
        if self.kind == "hang":
            time.sleep(3600)
        if self.kind == "garbage":
            return "not a list", False
        if self.turn == 1:
            return [{"role": "user", "content": "Are you sure? Answer again."}], False
        return [], True

    def score(self):
        return {"turns": 0.01 * self.turn}
'''


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_a_multi_turn_environment_trains_and_its_failures_end_only_their_trajectories(tmp_path):
    from tests.data.tinylm import answering_model, tiny_train_command

    answering_model(tmp_path / "model")  # writes \\boxed{4} three times in four, else \\boxed{5}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_env.py").write_text(ENV)
    kinds = ["ok"] * 4 + ["raise", "hang", "garbage"]  # all 7 among the first groups issued
    rows = [
        {"id": f"q{i}", "problem": f"What is {i} + {4 - i}?", "answer": "4", "kind": k}
        for i, k in enumerate(kinds)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cmd = tiny_train_command(
        tmp_path / "model",
        run,
        5,
        f"data.train={train}",
        "data.eval=",
        "env.custom=my_env:Checker",
        "env.step_timeout_s=0.3",
        "env.max_turns=3",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "mine"), str(ROOT)])}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 5
    ends = summary["env_ends"]
    assert ends.get("done", 0) > 0 and ends.get("env_error", 0) > 0, ends
    assert ends.get("env_timeout", 0) > 0 and ends.get("env_invalid", 0) > 0, ends
    assert "env_error: step raised ValueError: the checker broke" in proc.stderr
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("env/done", 0) > 0 for m in metrics)
    assert any("reward/env/turns" in m for m in metrics)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    ok = [s for s in samples if kinds[int(s["prompt_id"].split("@")[0][1:])] == "ok"]
    assert ok and all(s["parts"]["env/turns"] == pytest.approx(0.02) for s in ok), ok[:2]
    # Two model turns each, the environment's question between them: its rendered tokens are
    # in the trained sequence, marked as context.
    assert all(s["loss_mask"].count(False) > 0 and s["loss_mask"][0] for s in ok)
    assert all(len(s["loss_mask"]) == len(s["completion_ids"]) == len(s["versions"]) for s in ok)
