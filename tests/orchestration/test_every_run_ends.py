"""Every run ends: a custom reward that sleeps past its limit, raises, returns NaN or a string, or
hangs (ignoring the soft limit, so the pool kills its worker) costs its samples, never the run.

A real ``megatron-rl train`` per loop mode (async, sync, colocated): the misbehaving problems come
first (``data.shuffle=false``), so the first groups of training meet them, and the held-out set
has one of each, so the evaluations before and after training meet them too. The run must end on
its own with exit 0, the final evaluation's pass@1 reported and every failed sample counted with
its reason in eval.jsonl, the summary and metrics.jsonl. And ``run.time_limit_min`` stops a run
whose evaluation would take longer than the limit: checkpoint, cut evaluation, summary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

REWARD = '''
import signal
import time

from megatron_rl.rewards.format import last_boxed


def score(completion, problem):
    """1 for the right answer; a misbehaving record's samples misbehave as its kind says."""
    kind = problem["kind"]
    if kind == "sleep":  # past custom_timeout_s: the soft limit stops it (timeout)
        time.sleep(30)
    elif kind == "raise":  # verifier_error
        raise ValueError("no expectation for this one")
    elif kind == "nan":  # verifier_error
        return float("nan")
    elif kind == "string":  # verifier_error
        return "four"
    elif kind == "hang":  # deaf to the soft limit: the pool kills the worker (worker_timeout)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return float(last_boxed(completion) == str(problem["answer"]))
'''

KINDS = ["sleep", "raise", "nan", "string", "hang"]
# What each misbehaving kind scores as (eval.jsonl, summary, samples.jsonl).
EXPECTED = {
    "sleep": "timeout",
    "raise": "verifier_error",
    "nan": "verifier_error",
    "string": "verifier_error",
}
EXPECTED["hang"] = "worker_timeout"


def _problems(path: Path, kinds: list[str]) -> None:
    rows = [
        {"id": f"{k}{i}", "problem": f"What is {i} + {4 - i}?", "answer": "4", "kind": k}
        for i, k in enumerate(kinds)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _train(tmp_path: Path, *overrides: str, timeout: float = 420) -> tuple[subprocess.CompletedProcess, Path]:
    from tests.data.tinylm import answering_model, tiny_train_command

    answering_model(tmp_path / "model")  # \boxed{4} three times in four, else \boxed{5}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "misbehaving.py").write_text(REWARD)
    _problems(tmp_path / "train.jsonl", KINDS + ["ok"] * 5)
    _problems(tmp_path / "eval.jsonl", KINDS + ["ok"])
    run = tmp_path / "run"
    cmd = tiny_train_command(
        tmp_path / "model",
        run,
        1,
        f"data.train={tmp_path / 'train.jsonl'}",
        f"data.eval={tmp_path / 'eval.jsonl'}",
        "data.shuffle=false",
        "run.eval_k=2",
        "reward.custom=misbehaving:score",
        "reward.custom_timeout_s=0.5",
        "reward.task_timeout_s=2",  # the pool's hard limit per sample: a hang costs 2 s
        "reward.workers=2",
        *overrides,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "mine"), str(ROOT)])}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
@pytest.mark.parametrize("mode", ["async", "sync", "colocated"])
def test_a_misbehaving_reward_costs_its_samples_and_the_run_ends(tmp_path, mode):
    proc, run = _train(tmp_path, f"loop.mode={mode}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["stopped"] == "max_steps"

    # Training: the first groups were the misbehaving problems; each sample scored 0 with why.
    counted = summary["train_reasons"]
    # A whole group of each; in async mode the run may end (its scoring not yet started
    # cancelled) before the last of a group's samples is scored, e.g. a hang's fourth worker kill.
    least = 1 if mode == "async" else 4
    for kind in ("sleep", "raise", "hang"):
        assert counted.get(EXPECTED[kind], 0) >= least, counted
    for s in _jsonl(run / "samples.jsonl"):
        kind = s["prompt_id"].rstrip("0123456789")
        if kind in EXPECTED:
            assert s["reason"] == EXPECTED[kind] and s["parts"]["custom"] == 0.0, s
    (m,) = _jsonl(run / "metrics.jsonl")
    step = {k.removeprefix("samples/reason/"): n for k, n in m.items() if k.startswith("samples/reason/")}
    # The step's samples are counted under their reasons, none the run's totals lack. Which groups
    # make step 1 is the schedule's choice in async mode (a group still scoring joins a later
    # batch), so the exact counts are checked where the loop takes its groups in order.
    assert step and all(n <= counted.get(r, 0) for r, n in step.items()), (m, counted)
    if mode != "async":
        assert step.get("timeout", 0) >= 4 and step.get("verifier_error", 0) >= 12, m

    # The final evaluation: pass@1 reported, each failure counted under its reason.
    after = _jsonl(run / "eval.jsonl")[-1]
    assert after["label"] == "after" and after["step"] == 1 and not after.get("partial")
    assert summary["pass@1_after"] == after["pass@1"] is not None
    assert after["samples"] == 2 * (len(KINDS) + 1)
    reasons = after["reasons"]
    assert reasons["timeout"] == 2 and reasons["worker_timeout"] == 2 and reasons["verifier_error"] == 6
    assert summary["eval_after_reasons"] == reasons
    assert "[eval after] step 1: held-out pass@1" in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_the_time_limit_stops_a_run_in_its_evaluation(tmp_path):
    # Every held-out sample hangs until the pool kills it (2 s each, 2 workers): 40 samples take
    # 40 s or more, longer than the whole 0.5 min limit. The evaluation is cut there; the run
    # checkpoints, its final evaluation is cut at once, and it writes its summary.
    _problems(tmp_path / "hangs.jsonl", ["hang"] * 20)
    proc, run = _train(tmp_path, "run.time_limit_min=0.5", f"data.eval={tmp_path / 'hangs.jsonl'}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stopped"] == "time_limit" and summary["steps"] == 0
    assert "[time limit]" in proc.stderr and "cut short by run.time_limit_min" in proc.stderr
    evals = _jsonl(run / "eval.jsonl")
    assert [e["label"] for e in evals] == ["before", "after"]
    for e in evals:
        assert e["partial"] and e["reasons"].get("time_limit", 0) + e["reasons"].get("not_generated", 0) > 0
        assert sum(e["reasons"].values()) == 40  # every sample counted: scored, time_limit or not_generated
    assert summary["eval_after_partial"] is True
    assert list((run / "checkpoints").iterdir()), "no checkpoint at the time limit"
    assert (run / "hf" / "config.json").exists()
