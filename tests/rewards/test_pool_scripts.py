"""The verifier pool from a user's plain script (no ``if __name__ == "__main__":`` guard): its
workers never re-run the script, so the README's Python example scores as it says; what cannot
work from a script (a task or a reward defined in the script itself) is refused at once, in one
line. And a pool never leaves a caller waiting: a task past its caller's deadline, a warm-up
that fails, a dispatcher that dies."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.errors import UsageError
from megatron_rl.rewards.pool import PoolBroken, PoolTaskError, VerifierPool
from tests.rewards.test_pool import failing_warmup, sleep_for, square

ROOT = Path(__file__).resolve().parents[2]

# The README's Python API example, its scoring lines as they are: a script with no guard.
README_SCORE = """
from megatron_rl import score

results = score([{"problem": "What is 2 + 2?", "answer": "4",
                  "completion": "<think>Two and two make four.</think>It is $\\\\boxed{4}$."}])
print(results[0].reward, results[0].reason)      # 1.1 ok  (format + correct + language)
"""

# A pool of its own, a task function from a module: the workers must not run this file.
OWN_POOL = """
from megatron_rl.rewards.pool import VerifierPool
from tests.rewards.test_pool import square

print("script body ran")
with VerifierPool(2, preload=()) as pool:
    print(pool.map(square, [(3,), (4,)]))
"""

MAIN_TASK = """
from megatron_rl.rewards.pool import VerifierPool

def cube(x):
    return x ** 3

with VerifierPool(1, preload=()) as pool:
    pool.submit(cube, 2)
"""

MAIN_REWARD = """
from megatron_rl import score
from megatron_rl.rewards.compose import RewardConfig

def mine(completion, problem):
    return 1.0

score([{"problem": "p", "completion": "<think>a</think>\\\\boxed{1}"}], RewardConfig(custom="__main__:mine"))
"""


def _script(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "plain.py"
    path.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env
    )


def test_the_readme_python_example_runs_as_a_plain_script(tmp_path):
    proc = _script(tmp_path, README_SCORE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1.1 ok"
    assert "bootstrapping" not in proc.stderr and "Traceback" not in proc.stderr


def test_workers_do_not_run_the_script(tmp_path):
    proc = _script(tmp_path, OWN_POOL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["script body ran", "[9, 16]"]


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    ("text", "says"),
    [
        (MAIN_TASK, "'cube' is defined in the script being run (__main__)"),
        (MAIN_REWARD, "a function of the script being run cannot be loaded by the worker processes"),
    ],
    ids=["task", "reward"],
)
def test_what_a_script_defines_for_the_workers_is_refused_at_once_in_one_line(tmp_path, text, says):
    proc = _script(tmp_path, text)
    assert proc.returncode != 0
    assert says in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_a_task_defined_in_main_is_refused_in_process_too(monkeypatch):
    def local(x):
        return x

    monkeypatch.setattr(local, "__module__", "__main__")
    with VerifierPool(1, preload=()) as pool, pytest.raises(UsageError, match="move it into a module"):
        pool.submit(local, 1)


def test_a_task_past_its_callers_deadline_fails_as_scoring_timeout_and_never_runs():
    with VerifierPool(1, preload=()) as pool:
        busy = pool.submit(sleep_for, 1.0, timeout_s=5)
        queued = pool.submit(square, 3, timeout_s=5)
        t0 = time.monotonic()
        with pytest.raises(PoolTaskError) as e:
            pool.result(queued, time.monotonic() + 0.2)
        assert e.value.reason == "scoring_timeout" and time.monotonic() - t0 < 1.0
        assert queued.cancelled() and pool.result(busy) == 1.0
        assert time.monotonic() < pool.deadline()  # nothing queued: a start-up allowance ahead


@pytest.mark.fault("crash")
def test_a_failing_warmup_raises_its_reason_to_whoever_waits():
    with VerifierPool(num_workers=1, preload=(), warmup=failing_warmup) as pool:
        assert not pool.wait_ready(timeout_s=60)
        assert "RuntimeError: cannot build the grammar" in (pool.broken or "")
        with pytest.raises(PoolBroken, match="its warm-up raised RuntimeError: cannot build the grammar"):
            pool.submit(square, 2)


@pytest.mark.fault("crash")
def test_a_dispatcher_that_dies_fails_its_tasks_instead_of_hanging(monkeypatch):
    pool = VerifierPool(1, preload=())
    try:
        assert pool.map(square, [(2,)]) == [4]

        def broken(w):
            raise RuntimeError("a bug in the dispatcher")

        monkeypatch.setattr(pool, "_receive", broken)
        future = pool.submit(square, 3)
        with pytest.raises(PoolBroken, match="dispatcher stopped: RuntimeError: a bug in the dispatcher"):
            pool.result(future, time.monotonic() + 30)
    finally:
        pool.close()
