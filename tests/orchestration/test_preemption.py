"""The faults a cluster sends a run, on a real ``megatron-rl train`` (engine servers, verifier pool,
Megatron trainer): preemption by SIGTERM, SIGUSR1 or the stop file (a checkpoint at that step,
exit 0 in time, resume with no step lost or repeated), ``kill -9`` of the trainer (no process of
the run outlives it), a full disk while checkpointing (one line naming the path, the previous
checkpoint intact), and a metrics line torn by a crash (rewritten on resume)."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.orchestration.conftest import ROOT, read_jsonl, recipe, train_cmd

GRACE_S = 60


def _start(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    )


class _Family:
    """Every process the run started (children, grandchildren), seen while it ran: by PID and
    start time, so a reused PID is not mistaken for one of them."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {}

    def look(self) -> None:
        try:
            for p in self.root.children(recursive=True):
                try:
                    self.seen.setdefault(p.pid, p.create_time())
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass

    def alive(self) -> list[str]:
        out = []
        for pid, started in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return out


def _watch_until(proc: subprocess.Popen, family: _Family, predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        family.look()
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"the run exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _no_survivors(family: _Family, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while family.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not family.alive(), f"outlived the run: {family.alive()}"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
@pytest.mark.parametrize("how", ["SIGTERM", "stop-file"])  # SIGUSR1: the watchdog test
def test_preempted_at_a_random_step_saves_it_exits_0_in_time_and_resumes_exactly(tmp_path, policy, how):
    steps = 8
    path = recipe(
        tmp_path,
        policy,
        loop={"max_steps": steps, "max_dropped_batches": 64},
        run={"checkpoint_every": 100, "preempt_grace_s": GRACE_S},  # only the preemption saves
    )
    run = tmp_path / "run"
    at = random.Random(how).randint(1, steps // 2)  # after this many steps were logged
    proc = _start(train_cmd(path))
    family = _Family(proc.pid)
    try:
        _watch_until(proc, family, lambda: len(read_jsonl(run / "metrics.jsonl")) >= at, 400, f"step {at}")
        t0 = time.monotonic()
        if how == "stop-file":
            (run / "STOP").touch()
        else:
            os.kill(proc.pid, getattr(signal, how))  # the trainer only, as a scheduler's first signal
        out, err = proc.communicate(timeout=GRACE_S + 30)
        took = time.monotonic() - t0
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    assert took < GRACE_S, took
    summary = json.loads(out.strip().splitlines()[-1])
    stopped_at = summary["steps"]
    assert summary["stopped"] == "preempted" and at <= stopped_at < steps, summary
    assert summary["preempted_by"] == (how if how != "stop-file" else f"{run / 'STOP'} exists")
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"megatron-rl train: preempted ({summary['preempted_by']}) at step {stopped_at}")
    assert "Traceback" not in err
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert summary["checkpoint"] == str(run / "checkpoints" / f"step_{stopped_at:08d}")
    _no_survivors(family, 5.0)

    # Resume: from the preempted step to the end, no step lost or repeated.
    done = subprocess.run(train_cmd(path), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, steps + 1))
    trained = [
        (e["prompt_id"], e["epoch"]) for e in read_jsonl(run / "ledger.jsonl") if e["event"] == "trained"
    ]
    assert len(trained) == len(set(trained))
    final = json.loads(done.stdout.strip().splitlines()[-1])
    assert final["stopped"] == "max_steps" and final["resumed_from"].endswith(f"step_{stopped_at:08d}")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_kill_9_of_the_trainer_leaves_no_process_of_the_run(tmp_path, policy):
    """Servers, verifier workers, their forkserver and the resource tracker: none outlives a
    trainer killed with SIGKILL (to it alone: nothing could clean up), at a random point of
    its second step, checkpoint included."""
    path = recipe(tmp_path, policy, loop={"max_steps": 4, "max_dropped_batches": 64})
    run = tmp_path / "run"
    proc = _start(train_cmd(path))
    family = _Family(proc.pid)
    try:
        _watch_until(proc, family, lambda: len(read_jsonl(run / "metrics.jsonl")) >= 1, 400, "step 1")
        deadline = time.monotonic() + random.Random(9).uniform(0.0, 2.0)
        while time.monotonic() < deadline:
            family.look()
            time.sleep(0.05)
        kinds = " ".join(family.alive())
        assert "serve-engine" in kinds and "forkserver" in kinds, kinds  # what must not outlive it
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _no_survivors(family, 10.0)
    finally:
        _kill_group(proc)


def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_a_full_disk_while_checkpointing_is_named_and_the_previous_checkpoint_stays(tmp_path, policy):
    """The stand-in for a full disk is a file-size limit (ulimit -f): the checkpoint's tensors
    do not fit in one file; everything else the run writes does."""
    path = recipe(tmp_path, policy, loop={"max_steps": 1, "max_dropped_batches": 64})
    run = tmp_path / "run"
    first = subprocess.run(train_cmd(path), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = run / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in (ckpts / "step_00000001").rglob("*")}
    size = sum(p.stat().st_size for p in (ckpts / "step_00000001" / "dist").rglob("*") if p.is_file())
    full = subprocess.run(
        train_cmd(path, "loop.max_steps=2"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        preexec_fn=_limit_file_size(size // 2),
    )
    assert full.returncode == 5, full.stderr[-3000:]  # a resource, not a crash (70) or a stop (1)
    assert "Traceback" not in full.stderr
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f"megatron-rl train: {ckpts}: no room for checkpoint step 2"), line
    assert "ulimit -f" in line and f"{ckpts / 'step_00000001'} is intact" in line, line
    assert (ckpts / "latest").read_text().strip() == "step_00000001"
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]  # the partial save was removed
    assert {p.name: p.stat().st_mtime_ns for p in (ckpts / "step_00000001").rglob("*")} == before

    again = subprocess.run(
        train_cmd(path, "loop.max_steps=2"), cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from"].endswith("step_00000001")
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_a_metrics_line_torn_by_a_crash_is_rewritten_on_resume(tmp_path, policy):
    path = recipe(tmp_path, policy, loop={"max_steps": 2, "max_dropped_batches": 64})
    run = tmp_path / "run"
    first = subprocess.run(train_cmd(path), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = run / "metrics.jsonl"
    original = read_jsonl(metrics)
    text = metrics.read_text()
    metrics.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 40])  # step 2's line cut after 40 bytes
    assert [m["step"] for m in read_jsonl(metrics)] == [1]
    resumed = subprocess.run(
        train_cmd(path, "loop.max_steps=3"), cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"{metrics}: line 2 torn" in resumed.stderr
        and "step 2 rewritten from the checkpoint" in resumed.stderr
    )
    got = read_jsonl(metrics)
    assert [m["step"] for m in got] == [1, 2, 3]
    assert got[:2] == original


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_the_verifier_forkserver_and_resource_tracker_killed_mid_run_are_replaced(tmp_path, policy):
    """The pool's machinery (the forkserver its workers come from, multiprocessing's resource
    tracker) killed together mid-run, workers with them: replaced, and the run ends normally."""
    path = recipe(tmp_path, policy, loop={"max_steps": 3, "max_dropped_batches": 64})
    run = tmp_path / "run"
    proc = _start(train_cmd(path))
    family = _Family(proc.pid)
    try:
        _watch_until(proc, family, lambda: len(read_jsonl(run / "metrics.jsonl")) >= 1, 400, "step 1")
        helpers = [
            p
            for p in psutil.Process(proc.pid).children()
            if any(k in " ".join(p.cmdline()) for k in ("forkserver", "resource_tracker"))
        ]
        assert len(helpers) == 2, [p.cmdline() for p in helpers]
        for p in helpers:
            p.kill()
        out, err = proc.communicate(timeout=400)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 3


def test_past_the_grace_the_watchdog_ends_the_process_and_says_why(tmp_path, capsys):
    """A run that does not reach its step boundary in time (a hung collective, a slow save) is
    ended by the watchdog with exit 1; one that stops in time (uninstall) is not."""
    from megatron_rl.orchestration.preempt import Preemption

    exits: list[int] = []
    heard: list[str] = []
    p = Preemption(0.3, stop_file=tmp_path / "STOP", on_request=heard.append, exit=exits.append)
    (tmp_path / "STOP").touch()  # left by an earlier invocation: not a request to this one
    p.install()
    try:
        assert not (tmp_path / "STOP").exists()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert p.reason == "SIGUSR1" and heard == ["SIGUSR1"]
        os.kill(os.getpid(), signal.SIGTERM)  # a second request changes nothing
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        p.uninstall()
    assert exits == [1] and heard == ["SIGUSR1"]
    err = capsys.readouterr().err
    assert "not stopped within run.preempt_grace_s=0.3 s" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    exits.clear()
    q = Preemption(0.3, stop_file=tmp_path / "STOP", exit=exits.append)
    q.install()
    (tmp_path / "STOP").touch()
    deadline = time.monotonic() + 5
    while q.reason is None and time.monotonic() < deadline:
        time.sleep(0.05)
    q.uninstall()  # stopped in time
    time.sleep(0.5)
    assert q.reason == f"{tmp_path / 'STOP'} exists" and exits == []


def test_uninstall_leaves_no_thread_that_holds_the_run(tmp_path):
    """After uninstall no thread of the preemption runs and nothing of it keeps the run alive: a
    daemon thread that dropped the run's last reference while the interpreter finalized aborted
    a finished torchrun (SIGABRT, "terminate called without an active exception": the stop-file
    thread held ``on_request``, the run's bound method, and the model's tensors behind it)."""
    import gc
    import threading
    import weakref

    import torch

    from megatron_rl.orchestration.preempt import Preemption

    class Run:
        def __init__(self) -> None:
            self.weights = [torch.zeros(4)]

        def preempt(self, reason: str) -> None:
            pass

    for asked in (False, True):
        run = Run()
        gone = weakref.ref(run)
        p = Preemption(30.0, stop_file=tmp_path / "STOP", on_request=run.preempt, exit=lambda code: None)
        p.install()
        if asked:  # the watchdog's timer thread is started too
            (tmp_path / "STOP").touch()
            deadline = time.monotonic() + 5
            while p.reason is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert p.reason is not None
        p.uninstall()
        del run
        gc.collect()
        assert gone() is None  # nothing the preemption keeps refers to the run
        alive = [
            t.name
            for t in threading.enumerate()
            if t.name == "rl-stop-file" or isinstance(t, threading.Timer)
        ]
        assert alive == []


def _engine_pid(run: Path) -> int:
    return json.loads((run / "logs" / "pids.json").read_text())["engines"][0]["pid"]


def _server_pids(proc: subprocess.Popen) -> list[int]:
    """The run's live engine servers (a killed one not yet reaped is a zombie: not counted)."""
    out = []
    for p in psutil.Process(proc.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "serve-engine" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_the_only_local_server_killed_twice_comes_back_with_the_trainers_weights(tmp_path, policy):
    """One engine server, killed (SIGKILL) at two points of the run: each time it is started
    again on its port, gets the trainer's current weights before it generates (verified
    digests), and the run finishes every step."""
    path = recipe(
        tmp_path,
        policy,
        loop={"max_steps": 5, "max_dropped_batches": 64},
        fleet={"local_servers": 1, "max_slots": 16, "max_len": 160},
    )
    run = tmp_path / "run"
    proc = _start(train_cmd(path))
    family = _Family(proc.pid)
    killed = []
    try:
        for at in (1, 3):
            _watch_until(
                proc, family, lambda at=at: len(read_jsonl(run / "metrics.jsonl")) >= at, 400, f"step {at}"
            )
            _watch_until(proc, family, lambda: len(_server_pids(proc)) == 1, 200, "a live server")
            (pid,) = _server_pids(proc)
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
            _watch_until(
                proc,
                family,
                lambda pid=pid: _server_pids(proc) and _server_pids(proc) != [pid],
                200,
                "a restart",
            )
        out, err = proc.communicate(timeout=400)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    assert err.count("died (exit") == 2 and "starting it again (2/3)" in err, err[-3000:]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    # The second kill may land after the last rollout was generated: the steps count restarts
    # as they happen, the summary counts them all.
    assert [m["fleet/restarts"] for m in metrics] == sorted(m["fleet/restarts"] for m in metrics)
    assert 1.0 <= metrics[-1]["fleet/restarts"] <= 2.0
    # Every update that found the server (not mid-restart) left it with the trainer's weights.
    # An update that found it dead (the second kill may land after the last rollout) is skipped;
    # the server gets that version when it is back.
    assert all(m["weight_sync/verified"] == 1.0 for m in metrics if not m.get("weight_sync/skipped"))
    assert all(m.get("weight_sync/skipped") or "weight_sync/verified" in m for m in metrics)
    # The server started again after the first kill generated the later rollouts and took updates.
    assert any(m.get("weight_sync/verified") == 1.0 for m in metrics[1:])
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 5 and summary["fleet_restarts"] == 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_a_fleet_dead_past_its_timeout_stops_the_run_in_one_line(tmp_path, policy):
    path = recipe(
        tmp_path,
        policy,
        loop={"max_steps": 50, "max_dropped_batches": 64},
        fleet={
            "local_servers": 1,
            "max_slots": 16,
            "max_len": 160,
            "max_restarts": 0,
            "dead_fleet_timeout_s": 3,
        },
    )
    run = tmp_path / "run"
    proc = _start(train_cmd(path))
    family = _Family(proc.pid)
    try:
        _watch_until(proc, family, lambda: len(read_jsonl(run / "metrics.jsonl")) >= 1, 400, "step 1")
        (pid,) = _server_pids(proc)
        os.killpg(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("megatron-rl train: no generation server reachable for 3 s"), last
