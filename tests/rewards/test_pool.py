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


def identity(x):
    return x


def sleep_for(seconds):
    time.sleep(seconds)
    return seconds


def act(kind, arg=0):
    """One task function for mixed chunks: ``map`` queues a whole list at once, ``submit`` does not."""
    if kind == "sleep":
        time.sleep(3600)
    elif kind == "exit":
        os._exit(arg)
    elif kind == "segfault":
        ctypes.string_at(0)
    return os.getpid()


WARMED = []  # each worker's own copy: filled by its warm-up


def mark_warm():
    WARMED.append(os.getpid())


def was_warmed(_):
    return os.getpid() in WARMED


def failing_warmup():
    raise RuntimeError("cannot build the grammar")


def module_loaded(name):
    return name in sys.modules


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, preload=()) as p:
        yield p


@pytest.fixture(scope="module")
def solo():
    """One worker: every chunk goes to it, so a list handed to ``map`` is split in a known way."""
    with VerifierPool(num_workers=1, preload=()) as p:
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


def test_a_batch_goes_out_in_chunks_and_comes_back_in_order(pool):
    before = dict(pool.stats)
    assert pool.map(square, [(i,) for i in range(200)]) == [i * i for i in range(200)]
    assert pool.stats["tasks"] - before["tasks"] == 200
    assert pool.stats["chunks"] - before["chunks"] < 100  # many tasks per message


@pytest.mark.fault("crash")
def test_a_stuck_task_fails_alone_and_the_rest_of_its_chunk_runs_in_the_replacement(solo):
    before = solo.stats["requeued"]
    # 40 tasks queued at once: the first chunk holds several, the stuck one second among them.
    results = solo.map(act, [("pid",), ("sleep",)] + [("pid",)] * 38, timeout_s=1.0)
    assert isinstance(results[1], PoolTaskError) and results[1].reason == "worker_timeout"
    first, rest = results[0], results[2:]
    assert all(isinstance(r, int) for r in rest)
    assert first not in rest  # they ran after the kill, in the new worker
    assert solo.stats["requeued"] > before  # unstarted tasks of the killed worker's chunk


@pytest.mark.fault("crash")
def test_crashes_in_the_middle_of_a_chunk_fail_only_the_crashing_tasks(solo):
    kinds = [("pid",)] * 2 + [("exit", 3)] + [("pid",)] * 2 + [("segfault",)] + [("pid",)] * 20
    results = solo.map(act, kinds)
    crashed = {i: r for i, r in enumerate(results) if isinstance(r, PoolTaskError)}
    assert sorted(crashed) == [2, 5]
    assert all(r.reason == "worker_crash" for r in crashed.values())
    assert "exit code 3" in crashed[2].detail and "SIGSEGV" in crashed[5].detail
    assert all(isinstance(r, int) for i, r in enumerate(results) if i not in crashed)


def test_the_hard_limit_is_per_task_not_per_chunk(solo):
    # 64 tasks queued at once: the first chunk holds more than four, so its four 0.4 s naps
    # take 1.6 s, more than the 1.2 s each task is allowed.
    naps = [(0.4,)] * 4 + [(0.0,)] * 60
    assert solo.map(sleep_for, naps, timeout_s=1.2) == [n for (n,) in naps]


def test_an_unpicklable_argument_fails_only_its_task(pool):
    results = pool.map(identity, [(1,), (lambda: 0,), (3,)])
    assert results[0] == 1 and results[2] == 3
    assert results[1].reason == "verifier_error" and "could not send task" in results[1].detail


def described(shared, x, kind="pid"):
    """What a task sees of a shared argument (and it may crash its worker, as ``act`` does)."""
    if kind == "exit":
        os._exit(3)
    return shared["name"], len(shared["blob"]), x, os.getpid()


@pytest.mark.fault("crash")
def test_a_shared_argument_reaches_each_worker_once_and_a_replacement_too():
    shared = {"name": "reward config", "blob": b"x" * 100_000}
    with VerifierPool(num_workers=2, preload=()) as pool:
        pool.share(shared)
        got = pool.map(described, [(shared, i) for i in range(200)])
        assert [g[:3] for g in got] == [("reward config", 100_000, i) for i in range(200)]
        assert pool.stats["shared_sent"] == len({g[3] for g in got}) <= 2  # once per worker
        assert pool.stats["chunks"] > 2  # not once per chunk: far fewer sends than chunks
        # A worker that dies takes its copy along; its replacement is sent one before its first task.
        crashed = pool.map(described, [(shared, 0, "exit")])[0]
        assert isinstance(crashed, PoolTaskError) and crashed.reason == "worker_crash"
        after = pool.map(described, [(shared, i) for i in range(50)])
        assert [g[:3] for g in after] == [("reward config", 100_000, i) for i in range(50)]
        assert pool.stats["shared_sent"] == len({g[3] for g in got + after})
        # An argument equal to the shared one but another object is sent whole, as before.
        assert pool.map(described, [(dict(shared, name="a copy"), 1)])[0][:2] == ("a copy", 100_000)


def test_warmup_runs_in_every_worker_before_it_takes_tasks():
    with VerifierPool(num_workers=2, preload=(), warmup=mark_warm) as p:
        assert p.wait_ready(timeout_s=60)
        assert all(p.map(was_warmed, [(i,) for i in range(8)]))
        assert p.map(exit_hard, [(1,)])[0].reason == "worker_crash"
        assert all(p.map(was_warmed, [(i,) for i in range(8)]))  # the replacement too


def test_math_workers_import_math_verify_before_their_first_sample():
    from megatron_rl.rewards.math import warm_up

    with VerifierPool(num_workers=1, preload=(), warmup=warm_up) as p:
        assert p.map(module_loaded, [("math_verify",)]) == [True]


@pytest.mark.fault("crash")
def test_a_warmup_that_fails_breaks_the_pool():
    p = VerifierPool(num_workers=1, preload=(), warmup=failing_warmup)
    try:
        assert not p.wait_ready(timeout_s=60)
        with pytest.raises(RuntimeError, match="3 verifier processes in a row died while starting"):
            p.submit(square, 2)
    finally:
        p.close()


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


@pytest.mark.fault("load")
def test_close_with_cancel_drops_a_long_queue_at_once():
    """A finished run's leftover scoring: 40 tasks that would each run for an hour, cancelled
    (queued ones and the running ones alike) instead of waited for; no worker is left behind."""
    p = VerifierPool(2, default_timeout_s=3600)
    futures = [p.submit(sleep_forever, i) for i in range(40)]
    done = p.submit(square, 3)  # queued behind the sleepers: cancelled too
    while not any(w.chunk for w in p._workers):
        time.sleep(0.01)
    workers = [w.process for w in p._workers]
    t0 = time.monotonic()
    p.close(cancel=True)
    assert time.monotonic() - t0 < 60  # a guard against a hang, not a timing: waiting would take hours
    # Queued ones are cancelled; the ones already handed to a worker fail as cancelled.
    running = [f for f in futures if not f.cancelled()]
    assert done.cancelled() and 0 < len(running) < len(futures)
    for f in running:
        with pytest.raises(PoolTaskError, match="closed") as e:
            f.result(timeout=0)
        assert e.value.reason == "cancelled"
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(square, 2)


def test_deadline_counts_what_is_queued_or_running_while_submitters_and_workers_race(pool):
    """``deadline()`` sums the hard limits of the tasks without an outcome: read from many
    threads while groups are submitted and answered (it used to walk the workers' chunks as the
    dispatcher changed them: "deque mutated during iteration" in a scoring callback), it never
    raises, and once everything is answered it is back to the start-up allowance alone."""
    import threading

    errors: list[BaseException] = []
    stop = threading.Event()

    def read():
        while not stop.is_set():
            try:
                pool.deadline()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    futures = []
    for g in range(200):
        futures += pool.submit_many(
            identity, [(g * 16 + i,) for i in range(16)], timeout_s=[5.0 + i for i in range(16)]
        )
    queued = pool.deadline() - time.monotonic()
    assert [f.result(timeout=120) for f in futures] == list(range(3200))
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[:1]
    idle = pool.deadline() - time.monotonic()
    assert queued > idle + 1000  # thousands of seconds of limits were outstanding
    assert idle <= 30.0 + 0.5  # nothing outstanding: the start-up allowance only
    with pytest.raises(ValueError, match="one per item"):
        pool.submit_many(identity, [(1,), (2,)], timeout_s=[1.0])
