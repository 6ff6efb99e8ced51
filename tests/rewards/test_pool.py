import ctypes
import os
import subprocess
import sys
import time

import pytest

from megatron_rl.rewards.pool import PoolTaskError, VerifierPool


def square(x):
    return x * x


def pid_of_worker(_):
    return os.getpid()


def sleep_forever(_):
    time.sleep(3600)


def exit_hard(code):
    os._exit(code)


def segfault(_):
    ctypes.string_at(0)


def raise_value_error(msg):
    raise ValueError(msg)


def huge_power(_):
    return 9 ** (9**9)  # one C call: no signal can interrupt it


def unpicklable(_):
    return lambda: None


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, preload=()) as p:
        yield p


def test_results_in_input_order(pool):
    assert pool.map(square, [(i,) for i in range(50)]) == [i * i for i in range(50)]


@pytest.mark.fault("crash")
def test_stuck_workers_are_killed_and_replaced(pool):
    t0 = time.monotonic()
    results = pool.map(sleep_forever, [(0,), (1,)], timeout_s=1.0)
    assert all(isinstance(r, PoolTaskError) and r.reason == "worker_timeout" for r in results)
    cpu = pool.submit(huge_power, 0, timeout_s=1.0)
    with pytest.raises(PoolTaskError, match="worker_timeout"):
        cpu.result()
    assert time.monotonic() - t0 < 20
    assert pool.map(square, [(3,), (4,)]) == [9, 16]  # replacements work


@pytest.mark.fault("crash")
def test_crashes_score_failed_and_never_reach_the_caller(pool):
    results = pool.map(exit_hard, [(3,)]) + pool.map(segfault, [(0,)])
    assert [r.reason for r in results] == ["worker_crash", "worker_crash"]
    assert "exit code 3" in results[0].detail and "SIGSEGV" in results[1].detail
    assert pool.map(square, [(5,)]) == [25]


@pytest.mark.fault("crash")
def test_verifier_exception_keeps_the_worker(pool):
    before = set(pool.map(pid_of_worker, [(i,) for i in range(6)]))
    r = pool.map(raise_value_error, [("boom",)])[0]
    assert r.reason == "verifier_error" and "ValueError: boom" in r.detail
    r = pool.map(unpicklable, [(0,)])[0]
    assert r.reason == "verifier_error" and "could not be sent" in r.detail
    after = set(pool.map(pid_of_worker, [(i,) for i in range(6)]))
    assert before == after


def test_mixed_batch_keeps_order_and_ids(pool):
    items = [(square, 2), (sleep_forever, 0), (square, 3), (exit_hard, 1), (square, 4)]
    futures = [pool.submit(fn, x, timeout_s=1.5) for fn, x in items]
    got = []
    for f in futures:
        try:
            got.append(f.result())
        except PoolTaskError as e:
            got.append(e.reason)
    assert got == [4, "worker_timeout", 9, "worker_crash", 16]


def test_close_leaves_no_worker_behind():
    p = VerifierPool(num_workers=2, preload=())
    pids = set(p.map(pid_of_worker, [(i,) for i in range(4)]))
    p.close()
    time.sleep(0.2)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(square, 1)


BROKEN_START = """
import sys
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool
from tests.rewards.test_pool import square
if __name__ == "__main__":
    p = VerifierPool(num_workers=2, preload=("tests.rewards.exit_on_import",))
    try:  # the workers may all have died before this submit (then it raises) or after it
        p.submit(square, 2).result(timeout=60)
    except PoolTaskError as e:
        print("first:", e.reason, e.detail)
    except RuntimeError as e:
        print("first:", e)
    try:
        p.submit(square, 3)
    except RuntimeError as e:
        print("submit:", e)
    p.close()
"""


@pytest.mark.fault("crash")
def test_workers_that_cannot_start_break_the_pool_instead_of_spinning(tmp_path):
    # The forkserver (and its preload) is per process, so this runs in a fresh interpreter.
    # Every process forked from that server dies at once, as with a broken start-up.
    script = tmp_path / "broken_start.py"
    script.write_text(BROKEN_START)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert "3 verifier processes in a row died while starting" in proc.stdout, proc.stderr
    assert "first: worker_crash" in proc.stdout or "first: the verifier pool is broken" in proc.stdout
    assert "submit: the verifier pool is broken" in proc.stdout
