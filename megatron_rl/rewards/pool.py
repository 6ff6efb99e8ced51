"""A verifier pool that never hangs and never dies with its workers.

Verifiers run in worker processes (not threads: math-verify's time-outs use ``SIGALRM``, which only
works in a main thread, and a runaway SymPy call holds the GIL). Each worker is fed one task at a
time over its own pipe, so the pool always knows which task a worker runs and since when:

- a task past its hard wall-clock limit gets its worker killed (SIGKILL) and replaced; the task's
  future fails with reason ``worker_timeout``;
- a worker that dies (segfault, OOM kill, ``os._exit``) is replaced; its task fails with
  ``worker_crash``;
- an exception inside the verifier fails only that task, with ``verifier_error``; the worker stays.

Workers are started by a forkserver that has already imported the verifiers, so a replacement is
ready in milliseconds rather than re-importing SymPy (the forkserver is one per process: the first
pool's ``preload`` is the one that counts). A worker takes tasks only after it reports ready; if
three in a row die while starting, the pool fails its pending tasks with the reason and refuses
new ones rather than respawning forever. Workers die with the caller (``PR_SET_PDEATHSIG``), so a
killed trainer leaves no verifier behind.

    with VerifierPool(num_workers=2) as pool:
        results = pool.map(fn, [(a, b), (c, d)], timeout_s=10)   # in input order
        future = pool.submit(fn, a, b, timeout_s=10)            # concurrent.futures.Future
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

__all__ = ["PoolTaskError", "VerifierPool"]

_PR_SET_PDEATHSIG = 1
T = TypeVar("T")  # what a task returns


class PoolTaskError(Exception):
    """A task that produced no result: ``reason`` is worker_timeout, worker_crash or verifier_error."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _worker_main(conn: Connection) -> None:
    try:  # die with the parent, whatever kills it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn.send(("ready", os.getpid()))  # tasks go only to workers that started
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, fn, args = msg
        try:
            reply = ("result", task_id, True, fn(*args))
        except BaseException as e:  # noqa: BLE001 -- any failure is the task's, not the worker's
            reply = ("result", task_id, False, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 -- e.g. an unpicklable result
            conn.send(("result", task_id, False, f"result could not be sent back: {type(e).__name__}: {e}"))


@dataclass
class _Task:
    task_id: int
    fn: Callable
    args: tuple
    timeout_s: float
    future: Future = field(default_factory=Future)


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    task: _Task | None = None
    deadline: float = 0.0
    ready: bool = False  # said hello: it imported everything and waits for tasks


class VerifierPool:
    """Process pool with a hard wall-clock limit per task (see the module docstring)."""

    def __init__(
        self,
        num_workers: int = 2,
        *,
        default_timeout_s: float = 60.0,
        preload: Iterable[str] = ("megatron_rl.rewards.compose",),
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.default_timeout_s = default_timeout_s
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(preload))
        self._lock = threading.Lock()
        self._pending: deque[_Task] = deque()
        self._ids = itertools.count()
        self._closing = False
        self._broken: str | None = None  # why workers cannot start, once that is certain
        self._start_failures = 0  # consecutive workers that died before saying ready
        self.stats = {"tasks": 0, "worker_timeout": 0, "worker_crash": 0, "verifier_error": 0}
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers: list[_Worker] = []
        while len(self._workers) < num_workers and self._broken is None:
            try:
                self._workers.append(self._spawn())
            except OSError as e:
                # The child died during the forkserver's hand-over (a broken pipe): a worker that
                # cannot start, counted like one that dies before it is ready.
                self._start_failures += 1
                if self._start_failures >= 3:
                    self._broken = (
                        f"3 verifier processes in a row died while starting ({type(e).__name__}: {e})"
                    )
        self._thread = threading.Thread(target=self._loop, name="verifier-pool", daemon=True)
        self._thread.start()

    # -- public ------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., T], *args: object, timeout_s: float | None = None) -> Future[T]:
        """Run ``fn(*args)`` in a worker; the future fails with :class:`PoolTaskError` when the
        task times out, its worker dies or ``fn`` raises."""
        task = _Task(next(self._ids), fn, args, timeout_s or self.default_timeout_s)
        with self._lock:
            if self._closing:
                raise RuntimeError("the verifier pool is closed")
            if self._broken:
                raise RuntimeError(f"the verifier pool is broken: {self._broken}")
            self._pending.append(task)
        self._wake_w.send_bytes(b"")
        return task.future

    def map(self, fn: Callable, items: Iterable[tuple], *, timeout_s: float | None = None) -> list:
        """``fn(*item)`` for every item; results (or :class:`PoolTaskError`) in input order."""
        futures = [self.submit(fn, *item, timeout_s=timeout_s) for item in items]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except PoolTaskError as e:
                out.append(e)
        return out

    def close(self) -> None:
        """Finish the queued tasks, then stop the workers."""
        with self._lock:
            self._closing = True
        self._wake_w.send_bytes(b"")
        self._thread.join()
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dispatcher thread -------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="verifier")
        proc.start()
        child.close()
        return _Worker(process=proc, conn=parent)

    def _replace(self, w: _Worker, reason: str, detail: str) -> None:
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5)
        w.conn.close()
        if w.task is not None:
            self.stats[reason] += 1
            w.task.future.set_exception(PoolTaskError(reason, detail))
            w.task = None
        if not w.ready:
            # A worker that dies before it is ready is not a task's fault: the workers cannot
            # start (bad preload, no memory, broken main module). Retrying forever would spin.
            self._start_failures += 1
            if self._start_failures >= 3:
                self._workers.remove(w)
                self._break(f"3 verifier processes in a row died while starting ({detail})")
                return
        try:
            self._workers[self._workers.index(w)] = self._spawn()
        except Exception as e:  # noqa: BLE001 -- e.g. the forkserver itself is gone
            self._workers.remove(w)
            self._break(f"cannot start a verifier process: {type(e).__name__}: {e}")

    def _break(self, why: str) -> None:
        with self._lock:
            self._broken = why
            pending, self._pending = list(self._pending), deque()
        for task in pending:
            task.future.set_exception(PoolTaskError("worker_crash", why))

    @staticmethod
    def _exit_status(w: _Worker) -> str:
        w.process.join(timeout=2)  # the pipe closes a moment before the exit status is known
        code = w.process.exitcode
        if code is None:
            return "exit status unknown"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _dispatch(self) -> bool:
        """Give pending tasks to idle workers; True when the pool may stop."""
        dead = []
        with self._lock:
            for w in self._workers:
                while w.ready and w.task is None and self._pending:
                    task = self._pending.popleft()
                    if not task.future.set_running_or_notify_cancel():
                        continue
                    try:
                        w.conn.send((task.task_id, task.fn, task.args))
                    except OSError:  # the worker died while idle: the task never ran, requeue it
                        self._pending.appendleft(task)
                        dead.append(w)
                        break
                    except Exception as e:  # noqa: BLE001 -- arguments that cannot be pickled
                        task.future.set_exception(
                            PoolTaskError("verifier_error", f"could not send task: {e}")
                        )
                        continue
                    w.task, w.deadline = task, time.monotonic() + task.timeout_s
        for w in dead:
            self._replace(w, "worker_crash", f"verifier process died ({self._exit_status(w)})")
        with self._lock:
            idle = all(w.task is None for w in self._workers)
            return idle and (self._broken is not None or (self._closing and not self._pending))

    def _loop(self) -> None:
        while not self._dispatch():
            busy = [w for w in self._workers if w.task is not None]
            watched = list(self._workers)  # idle ones too: a worker may die while waiting
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic()) if busy else None
            for obj in wait([w.conn for w in watched] + [self._wake_r], timeout=timeout):
                if obj is self._wake_r:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                    continue
                w = next(w for w in watched if w.conn is obj)
                try:
                    kind, *msg = w.conn.recv()
                except (EOFError, OSError):
                    self._replace(w, "worker_crash", f"verifier process died ({self._exit_status(w)})")
                    continue
                if kind == "ready":
                    w.ready, self._start_failures = True, 0
                    continue
                _, ok, payload = msg
                task, w.task = w.task, None
                if task is None:  # a worker answers only the task it was sent
                    raise RuntimeError(f"verifier worker {w.process.pid} sent a result with no task")
                self.stats["tasks"] += 1
                if ok:
                    task.future.set_result(payload)
                else:
                    self.stats["verifier_error"] += 1
                    task.future.set_exception(PoolTaskError("verifier_error", payload))
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    self._replace(
                        w,
                        "worker_timeout",
                        f"no result within the hard limit of {w.task.timeout_s:g} s; worker killed",
                    )
