"""A verifier pool that never hangs and never dies with its workers.

Verifiers run in worker processes (not threads: math-verify's time-outs use ``SIGALRM``, which only
works in a main thread, and a runaway SymPy call holds the GIL). A worker is sent a *chunk* of
tasks in one message, runs them in order and sends each result back as soon as it has it. So the
pool always knows which task a worker runs and since when -- the first unanswered one of its chunk,
since the previous answer (or the chunk) -- and the hard limit stays per task:

- a task past its hard wall-clock limit gets its worker killed (SIGKILL) and replaced; the task's
  future fails with reason ``worker_timeout``; the tasks of its chunk that had not started go back
  to the front of the queue, to run in another worker;
- a worker that dies (segfault, OOM kill, ``os._exit``) is replaced; its task fails with
  ``worker_crash`` and the rest of its chunk is queued again the same way;
- an exception inside the verifier fails only that task, with ``verifier_error``; the worker stays.

Chunks are sized to the queue (``guided`` scheduling): an idle worker takes 1/4 of its share of
what is queued, at most ``_MAX_CHUNK``, so a scoring batch of hundreds of samples costs a few dozen
messages while the last chunks shrink to single tasks and the workers finish together; a
group of tasks submitted together (as rollouts do, a group's G samples) still goes out at once.

Workers are started by a forkserver that has already imported the verifiers (math-verify and SymPy
included), so a replacement is ready in milliseconds rather than re-importing them (the forkserver
is one per process: the first pool's ``preload`` is the one that counts). A worker runs the pool's
``warmup`` (e.g. :func:`megatron_rl.rewards.math.warm_up`) and only then reports ready and takes
tasks; if three in a row die while starting, the pool fails its pending tasks with the reason and
refuses new ones rather than respawning forever. Workers die with the caller
(``PR_SET_PDEATHSIG``), so a killed trainer leaves no verifier behind.

Workers do not run the caller's ``__main__``: multiprocessing would re-run the script in every
worker (as ``__mp_main__``), so a script without an ``if __name__ == "__main__":`` guard would
start pools inside its own workers, which die while starting. The pool needs nothing from the
script: its task functions are named by module path (a function defined in the script itself is
refused at :meth:`VerifierPool.submit`, and a custom reward is ``module:function``). A pool whose
workers cannot start raises :class:`PoolBroken` (one line: why, and what to change) to whoever
waits on it, never scores its samples ``worker_crash`` in silence.

**Every wait has a deadline.** :meth:`VerifierPool.deadline` is when everything queued now is
done at the latest if every task keeps to its hard limit (Graham's bound for list scheduling:
the sum of the limits over the workers, plus the longest limit, plus a start-up allowance);
:meth:`VerifierPool.result` waits for one task until a deadline, and past it the task (cancelled
when it has not started) counts as failed with reason ``scoring_timeout``. That deadline is met
unless the pool itself is wedged (its dispatcher thread dead): then the caller still goes on.

    with VerifierPool(num_workers=2) as pool:
        results = pool.map(fn, [(a, b), (c, d)], timeout_s=10)   # in input order
        future = pool.submit(fn, a, b, timeout_s=10)            # concurrent.futures.Future
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import io
import itertools
import multiprocessing as mp
import os
import pickle
import selectors
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import forkserver, popen_forkserver, reduction, spawn
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from multiprocessing.process import BaseProcess
from typing import TypeVar

from megatron_rl.errors import RunStopped, UsageError

__all__ = ["PoolBroken", "PoolTaskError", "VerifierPool", "max_workers"]

_PR_SET_PDEATHSIG = 1
_IN_WORKER = False  # set in a verifier process: no pool may start there
T = TypeVar("T")  # what a task returns

# Chunk size = ceil(queued / (_CHUNKS_PER_WORKER * workers)), capped. A message round trip through
# the dispatcher thread costs ~0.1-0.3 ms; a math sample ~10 ms, so any chunk of a few tasks makes
# the round trips negligible, and a bigger one only buys a longer tail: a worker held up by a slow
# sample (up to its math-verify time-outs, seconds) holds the rest of its chunk too. Four chunks
# per worker's share bounds that, and the cap bounds it (and the message size, code tasks carry
# their tests) for large batches.
_CHUNKS_PER_WORKER = 4
_MAX_CHUNK = 16
# The deadline's allowances: a worker's start (fork, warm-up imports such as math-verify's, a few
# seconds on a loaded machine) and a replacement after each kill, both generous.
_START_S = 30.0
_RESPAWN_S = 2.0


class PoolTaskError(Exception):
    """A task that produced no result: ``reason`` is worker_timeout, worker_crash, verifier_error,
    scoring_timeout (its caller's deadline passed, :meth:`VerifierPool.result`) or cancelled
    (``close(cancel=True)``)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PoolBroken(RunStopped, RuntimeError):
    """The pool's workers cannot start (or its dispatcher stopped): no task will ever run. The
    message says why in one line, and what to change where it can tell."""


class _NoMainPopen(popen_forkserver.Popen):
    """A forkserver start that does not re-run the caller's ``__main__`` in the worker (see the
    module docstring). The same steps as the standard library's ``_launch`` (CPython 3.8-3.13),
    with the main module left out of the preparation data."""

    def _launch(self, process_obj: BaseProcess) -> None:
        prep = spawn.get_preparation_data(process_obj.name)
        prep.pop("init_main_from_path", None)
        prep.pop("init_main_from_name", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        fds: list[int] = self._fds  # type: ignore[attr-defined]  # set by Popen.__init__ (untyped stdlib)
        self.sentinel, w = forkserver.connect_to_new_process(fds)
        parent_w = os.dup(w)  # the child watches this end to learn that the parent died
        close_fds = mp_util.close_fds  # type: ignore[attr-defined]  # untyped in typeshed
        self.finalizer = mp_util.Finalize(self, close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _WorkerProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _NoMainPopen:
        return _NoMainPopen(process_obj)


# A verifier process's copies of the objects its pool shares (VerifierPool.share), by key: sent
# once, before the first chunk that names them; a task's pickle then carries a _Shared reference.
_SHARED: dict[int, object] = {}


def _shared_object(key: int) -> object:
    """What a :class:`_Shared` reference unpickles to in a verifier process."""
    return _SHARED[key]


class _Shared:
    """A reference to a shared object, pickled as its key: ``(_shared_object, (key,))``."""

    __slots__ = ("key",)

    def __init__(self, key: int):
        self.key = key

    def __reduce__(self) -> tuple[Callable[[int], object], tuple[int]]:
        return _shared_object, (self.key,)


def _worker_main(conn: Connection, warmup: Callable[[], object] | None) -> None:
    try:  # die with the parent, whatever kills it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    global _IN_WORKER
    _IN_WORKER = True
    if warmup is not None:
        try:
            warmup()
        except BaseException as e:  # a start failure: the parent is told why, then it dies (re-raised)
            conn.send(("failed", f"{type(e).__name__}: {e}"[:500]))
            raise
    conn.send(("ready", os.getpid()))  # tasks go only to workers that started
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ids, blob, defs = msg
        try:  # unpickled here, so that a task that cannot be loaded fails alone, not the worker
            if defs:
                _SHARED.update(pickle.loads(defs))
            chunk = pickle.loads(blob)
        except BaseException as e:  # noqa: BLE001
            why = f"task could not be loaded in the verifier process: {type(e).__name__}: {e}"
            for task_id in ids:
                conn.send(("result", task_id, False, why))
            continue
        for task_id, fn, args in chunk:
            try:
                reply = ("result", task_id, True, fn(*args))
            except BaseException as e:  # noqa: BLE001 -- any failure is the task's, not the worker's
                reply = ("result", task_id, False, f"{type(e).__name__}: {e}")
            try:
                conn.send(reply)  # at once: the parent starts the next task's clock on it
            except Exception as e:  # noqa: BLE001 -- e.g. an unpicklable result
                conn.send(
                    ("result", task_id, False, f"result could not be sent back: {type(e).__name__}: {e}")
                )


@dataclass
class _Task:
    task_id: int
    fn: Callable
    args: tuple
    timeout_s: float
    future: Future = field(default_factory=Future)


@dataclass(eq=False)  # a worker is itself: compared and found by identity
class _Worker:
    process: BaseProcess
    conn: Connection
    chunk: deque[_Task] = field(default_factory=deque)  # sent and unanswered, in the order it runs them
    head_since: float = 0.0  # when chunk[0] started, as seen here: chunk sent or previous answer read
    ready: bool = False  # said hello: it imported and warmed everything and waits for tasks
    start_error: str = ""  # what its warm-up raised, when it said so before dying
    known: set[int] = field(default_factory=set)  # keys of the shared objects it has been sent

    @property
    def deadline(self) -> float:
        return self.head_since + self.chunk[0].timeout_s


_dumps = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)


def max_workers() -> int:
    """Most verifier processes one pool may start here: a few per core keeps sandboxed programs
    busy while others wait on I/O; far more only thrashes the machine (each worker holds an
    interpreter and its verifiers), and a typo such as ``workers: 20000`` must not fork 20,000."""
    return 8 * (os.cpu_count() or 1)


class VerifierPool:
    """Process pool with a hard wall-clock limit per task (see the module docstring)."""

    def __init__(
        self,
        num_workers: int = 2,
        *,
        default_timeout_s: float = 60.0,
        preload: Iterable[str] = ("megatron_rl.rewards.compose", "math_verify"),
        warmup: Callable[[], object] | None = None,
    ):
        """``preload``: modules the forkserver imports once for every worker (one missing is
        skipped); ``warmup``: a picklable function each worker runs before it takes tasks."""
        if not 1 <= num_workers <= max_workers():
            raise UsageError(
                f"workers: must be in [1, {max_workers()}] on this machine ({os.cpu_count()} cores), "
                f"got {num_workers}"
            )
        if _IN_WORKER:
            raise UsageError(
                "a verifier pool was started inside a verifier process: a module the verifier "
                "processes import (your reward's) runs scoring code when it is imported; put that "
                'code under `if __name__ == "__main__":`'
            )
        self.default_timeout_s = default_timeout_s
        self._warmup = warmup
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(preload))
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # a worker became ready or the pool broke
        self._pending: deque[_Task] = deque()
        # The hard limits of the tasks without an outcome yet (queued or running): what
        # deadline() sums. Kept by count as tasks come and go (each future's done callback), so a
        # deadline costs O(distinct limits), not a walk over thousands of queued tasks under the
        # dispatcher's lock.
        self._limits_lock = threading.Lock()
        self._limits: Counter[float] = Counter()
        self._limit_sum = 0.0
        self._ids = itertools.count()
        self._closing = False
        self._cancel = False  # close(cancel=True): stop without waiting for running chunks
        self._broken: str | None = None  # why workers cannot start, once that is certain
        self._start_failures = 0  # consecutive workers that died before saying ready
        self.stats = {
            "tasks": 0,  # answered (a result or verifier_error)
            "chunks": 0,  # messages that carried tasks to workers
            "requeued": 0,  # tasks sent back to the queue when their worker was killed or died
            "worker_timeout": 0,
            "worker_crash": 0,
            "verifier_error": 0,
            "shared_sent": 0,  # shared objects sent to a worker (each once per worker: share())
        }
        # Objects many tasks take as an argument (share()): id -> (key, object), held here.
        self._shared: dict[int, tuple[int, object]] = {}
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        # A wake-up is written and not yet read (under _lock): a burst of submits writes one.
        self._woken = False
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
        self._thread = threading.Thread(target=self._run, name="verifier-pool", daemon=True)
        self._thread.start()

    # -- public ------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., T], *args: object, timeout_s: float | None = None) -> Future[T]:
        """Run ``fn(*args)`` in a worker; the future fails with :class:`PoolTaskError` when the
        task times out, its worker dies or ``fn`` raises."""
        return self.submit_many(fn, [args], timeout_s=timeout_s)[0]

    def submit_many(
        self,
        fn: Callable[..., T],
        items: Iterable[tuple],
        *,
        timeout_s: Sequence[float] | float | None = None,
    ) -> list[Future[T]]:
        """:meth:`submit` for every item at once (one lock, one wake-up of the dispatcher: a
        group's G samples cost what one does); ``timeout_s`` one per item, or one for all."""
        return self._enqueue(fn, list(items), timeout_s)

    def share(self, obj: object) -> None:
        """Send ``obj`` to each worker once, not with every task that takes it as an argument
        (the reward config: two thirds of a math task's pickle). It is pickled as it is now:
        a shared object must not change afterwards (a changed copy would not reach the
        workers). Held by the pool until it closes."""
        with self._lock:
            if id(obj) not in self._shared:
                self._shared[id(obj)] = (len(self._shared), obj)

    def map(self, fn: Callable, items: Iterable[tuple], *, timeout_s: float | None = None) -> list:
        """``fn(*item)`` for every item; results (or :class:`PoolTaskError`) in input order."""
        futures = self.submit_many(fn, items, timeout_s=timeout_s)  # queued at once: chunked from the start
        deadline = self.deadline()
        out = []
        for f in futures:
            try:
                out.append(self.result(f, deadline))
            except PoolTaskError as e:
                out.append(e)
        return out

    def limits(self, timeout_s: Sequence[float] | float | None, n: int) -> list[float]:
        """The hard limit of each of ``n`` tasks: ``timeout_s`` one per task, one for all, or
        (None, 0) ``default_timeout_s``."""
        if timeout_s is None or isinstance(timeout_s, (int, float)):
            return [float(timeout_s or self.default_timeout_s)] * n
        limits = [float(t or self.default_timeout_s) for t in timeout_s]
        if len(limits) != n:
            raise ValueError(f"timeout_s: one per item ({n}), got {len(limits)}")
        return limits

    @property
    def broken(self) -> str | None:
        """Why no task can run any more (workers that cannot start), or None."""
        with self._lock:
            return self._broken

    def deadline(self) -> float:
        """A ``time.monotonic()`` by which every task queued or running now has an outcome, if
        every task keeps to its hard limit (see the module docstring)."""
        with self._limits_lock:
            n = sum(self._limits.values())
            longest = max(self._limits) if n else 0.0
            total = self._limit_sum + _RESPAWN_S * n
        workers = max(1, len(self._workers))
        if not n:
            return time.monotonic() + _START_S
        return time.monotonic() + _START_S + total / workers + longest + _RESPAWN_S

    def result(
        self, future: Future[T], deadline: float | None = None, *, reason: str = "scoring_timeout"
    ) -> T:
        """``future.result()``, waiting until ``deadline`` (``time.monotonic()``; default:
        :meth:`deadline` now). Past it, :class:`PoolTaskError` with ``reason`` (the task is
        cancelled if it has not started, so it will not run); :class:`PoolBroken` when the pool
        cannot run tasks any more."""
        if deadline is None:
            deadline = self.deadline()
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise PoolTaskError(
                reason, "no result by its deadline; the sample is counted as failed"
            ) from None
        except concurrent.futures.CancelledError:
            raise PoolTaskError("cancelled", "the task was cancelled") from None
        except PoolTaskError:
            why = self.broken
            if why is not None:
                raise PoolBroken(why) from None
            raise

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until every worker has started and run ``warmup``; False on time-out or when the
        pool is broken. Nothing needs it (tasks wait for a ready worker): it keeps start-up out
        of a measurement or a first batch's latency."""
        with self._ready:
            self._ready.wait_for(
                lambda: self._broken is not None or all(w.ready for w in self._workers), timeout_s
            )
            return self._broken is None and all(w.ready for w in self._workers)

    def close(self, *, cancel: bool = False) -> None:
        """Finish the queued tasks, then stop the workers. With ``cancel``, the tasks not yet
        started are cancelled instead (their futures end ``cancelled()``) and busy workers are
        killed, their tasks cancelled too: what a finished run does with scoring nobody will
        read (a slow verifier may have left a long queue behind)."""
        with self._lock:
            self._closing = True
            self._cancel = cancel
            dropped = list(self._pending) if cancel else []
            if cancel:
                self._pending.clear()
        for task in dropped:
            task.future.cancel()
        self._wake_w.send_bytes(b"")
        # Finishing the queue takes at most its deadline (cancelling: a moment); past it (a wedged
        # dispatcher), stop anyway.
        self._thread.join(timeout=_START_S if cancel else max(0.0, self.deadline() - time.monotonic()))
        if self._thread.is_alive():
            cancel = True
            with self._lock:
                self._cancel = True
        if cancel:  # the dispatcher stopped without waiting: busy workers go now, their tasks too
            for w in self._workers:
                if w.chunk:
                    w.process.kill()
                    for task in w.chunk:  # sent: their futures run, and cannot be cancelled
                        if not task.future.cancel():
                            task.future.set_exception(PoolTaskError("cancelled", "the pool was closed"))
                    w.chunk.clear()
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5)  # SIGKILL: a moment, unless the kernel itself is stuck

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- callers' side -----------------------------------------------------------------------
    def _enqueue(
        self, fn: Callable, arg_lists: list[tuple], timeout_s: Sequence[float] | float | None
    ) -> list[Future]:
        if getattr(fn, "__module__", None) == "__main__":
            raise UsageError(
                f"{getattr(fn, '__qualname__', fn)!r} is defined in the script being run (__main__), "
                "which the verifier processes do not run: move it into a module and import it from there"
            )
        limits = self.limits(timeout_s, len(arg_lists))
        tasks = [_Task(next(self._ids), fn, args, limit) for args, limit in zip(arg_lists, limits)]
        with self._lock:
            if self._closing:
                raise RuntimeError("the verifier pool is closed")
            if self._broken:
                raise PoolBroken(f"the verifier pool is broken: {self._broken}")
            with self._limits_lock:
                self._limits.update(limits)
                self._limit_sum += sum(limits)
            self._pending.extend(tasks)
            wake, self._woken = not self._woken, True
        for t in tasks:  # whatever ends it (result, failure, cancel), its limit leaves the sum
            t.future.add_done_callback(functools.partial(self._task_done, t.timeout_s))
        if wake:  # else the dispatcher has a wake-up to read, and takes these tasks with it
            self._wake_w.send_bytes(b"")
        return [t.future for t in tasks]

    def _task_done(self, limit: float, _future: Future) -> None:
        with self._limits_lock:
            self._limits[limit] -= 1
            if self._limits[limit] <= 0:
                del self._limits[limit]
            self._limit_sum = max(0.0, self._limit_sum - limit) if self._limits else 0.0

    # -- dispatcher thread -------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = _WorkerProcess(target=_worker_main, args=(child, self._warmup), daemon=True, name="verifier")
        proc.start()
        child.close()
        return _Worker(process=proc, conn=parent)

    def _replace(self, w: _Worker, reason: str, detail: str) -> None:
        """Kill ``w`` and start another; its running task fails, its unstarted ones are requeued."""
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5)
        w.conn.close()
        if w.chunk:
            # Answers come back in order and every answer sent before the end was read (a pipe
            # delivers its data before EOF), so the first unanswered task is the one that ran.
            task = w.chunk.popleft()
            self.stats[reason] += 1
            task.future.set_exception(PoolTaskError(reason, detail))
            self._requeue(list(w.chunk))
            w.chunk.clear()
        if not w.ready:
            # A worker that dies before it is ready is not a task's fault: the workers cannot
            # start (bad preload or warm-up, no memory). Retrying forever would spin.
            self._start_failures += 1
            if self._start_failures >= 3:
                with self._lock:
                    self._workers.remove(w)
                why = f"its warm-up raised {w.start_error}" if w.start_error else detail
                self._break(f"3 verifier processes in a row died while starting ({why})")
                return
        while True:
            try:
                new = self._spawn()
                break
            except OSError as e:
                # The child died during the forkserver's hand-over (a broken pipe): a worker that
                # cannot start, counted as in __init__, so a start-up that always fails breaks the
                # pool with that reason after three, whichever step the dying happens in.
                self._start_failures += 1
                if self._start_failures < 3:
                    continue
                with self._lock:
                    self._workers.remove(w)
                self._break(f"3 verifier processes in a row died while starting ({type(e).__name__}: {e})")
                return
            except Exception as e:  # noqa: BLE001 -- e.g. the forkserver itself is gone
                with self._lock:
                    self._workers.remove(w)
                self._break(f"cannot start a verifier process: {type(e).__name__}: {e}")
                return
        with self._lock:  # wait_ready reads the list
            self._workers[self._workers.index(w)] = new

    def _requeue(self, tasks: list[_Task]) -> None:
        """Put tasks that never started back at the front of the queue, in their order."""
        if not tasks:
            return
        self.stats["requeued"] += len(tasks)
        with self._lock:
            why = self._broken
            if why is None:
                self._pending.extendleft(reversed(tasks))
                return
        for task in tasks:
            task.future.set_exception(PoolTaskError("worker_crash", why))

    def _break(self, why: str) -> None:
        with self._lock:
            self._broken = why
            pending, self._pending = list(self._pending), deque()
            self._ready.notify_all()
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

    def _take_chunk(self) -> list[_Task]:
        """The next chunk from the front of the queue (under the lock); cancelled tasks dropped."""
        size = -(-len(self._pending) // (_CHUNKS_PER_WORKER * len(self._workers)))
        chunk: list[_Task] = []
        while self._pending and len(chunk) < min(size, _MAX_CHUNK):
            task = self._pending.popleft()
            # A requeued task is already running (its future cannot be cancelled any more).
            if task.future.running() or task.future.set_running_or_notify_cancel():
                chunk.append(task)
        return chunk

    def _send(self, w: _Worker, chunk: list[_Task]) -> None:
        """Send a chunk to idle ``w`` (under the lock); OSError when ``w`` has died. Tasks that
        cannot be pickled fail here and are dropped from ``chunk``."""
        # Plain pickle, not multiprocessing's ForkingPickler (a task carries no descriptor or
        # shared memory; ForkingPickler copies the copyreg table per call, and Connection.send
        # pickles through it once more): the worker's recv() and loads read plain pickles.
        used: set[int] = set()
        try:  # fn and shared args pickled once; the worker unpickles (see _worker_main)
            blob = _dumps([self._wire(t, used) for t in chunk])
        except Exception:  # noqa: BLE001 -- arguments that cannot be pickled: find them, send the rest
            sendable = []
            for t in chunk:
                try:
                    _dumps(self._wire(t, set()))
                except Exception as e:  # noqa: BLE001
                    self.stats["verifier_error"] += 1
                    t.future.set_exception(PoolTaskError("verifier_error", f"could not send task: {e}"))
                else:
                    sendable.append(t)
            chunk[:] = sendable  # in place: on OSError below, the caller requeues only these
            used.clear()
            blob = _dumps([self._wire(t, used) for t in chunk])
        if chunk:
            new = used - w.known
            defs = _dumps({key: obj for key, obj in self._shared.values() if key in new}) if new else b""
            w.conn.send_bytes(_dumps(([t.task_id for t in chunk], blob, defs)))
            w.known |= new
            self.stats["shared_sent"] += len(new)
            self.stats["chunks"] += 1
            w.chunk.extend(chunk)
            w.head_since = time.monotonic()

    def _wire(self, t: _Task, used: set[int]) -> tuple[int, Callable, tuple]:
        """``t`` as it is pickled: a shared argument as its reference (its key added to ``used``)."""
        if not self._shared:
            return t.task_id, t.fn, t.args
        args = []
        for a in t.args:
            entry = self._shared.get(id(a))
            if entry is not None and entry[1] is a:
                used.add(entry[0])
                args.append(_Shared(entry[0]))
            else:
                args.append(a)
        return t.task_id, t.fn, tuple(args)

    def _dispatch(self) -> bool:
        """Give pending tasks to idle workers; True when the pool may stop."""
        dead = []
        with self._lock:
            for w in self._workers:
                while w.ready and not w.chunk and self._pending:
                    chunk = self._take_chunk()
                    if not chunk:  # all cancelled
                        continue
                    try:
                        self._send(w, chunk)
                    except OSError:  # the worker died while idle: the chunk never ran, requeue it
                        self._pending.extendleft(reversed(chunk))
                        dead.append(w)
                        break
        for w in dead:
            self._replace(w, "worker_crash", f"verifier process died ({self._exit_status(w)})")
        with self._lock:
            idle = self._cancel or all(not w.chunk for w in self._workers)
            return idle and (self._broken is not None or (self._closing and not self._pending))

    def _receive(self, w: _Worker) -> None:
        """Read a message ``w`` has sent (the next select reports any other); replace ``w`` when it
        has died. (``Connection.poll`` would build a selector per call.)"""
        try:
            kind, *msg = w.conn.recv()
        except (EOFError, OSError):
            self._replace(w, "worker_crash", f"verifier process died ({self._exit_status(w)})")
            return
        if kind == "ready":
            with self._ready:
                w.ready, self._start_failures = True, 0
                self._ready.notify_all()
        elif kind == "failed":  # its warm-up raised; it dies next
            w.start_error = str(msg[0])
        else:
            task_id, ok, payload = msg
            if not w.chunk or w.chunk[0].task_id != task_id:  # it answers in the order sent
                raise RuntimeError(f"verifier worker {w.process.pid} answered task {task_id} out of turn")
            task = w.chunk.popleft()
            w.head_since = time.monotonic()  # the next task of the chunk starts now
            self.stats["tasks"] += 1
            if ok:
                task.future.set_result(payload)
            else:
                self.stats["verifier_error"] += 1
                task.future.set_exception(PoolTaskError("verifier_error", payload))

    def _run(self) -> None:
        """The dispatcher thread: :meth:`_loop`, and if that ever raises (a bug), every task
        still waiting fails with the reason instead of leaving its caller waiting."""
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 -- the pool's own failure reaches every caller
            why = f"the verifier pool's dispatcher stopped: {type(e).__name__}: {e}"
            self._break(why)
            for w in list(self._workers):
                w.process.kill()
                for task in w.chunk:
                    if not task.future.done():
                        task.future.set_exception(PoolTaskError("worker_crash", why))
                w.chunk.clear()

    def _loop(self) -> None:
        # One selector for the whole run, not one per wait (multiprocessing's wait() builds and
        # fills a new one each call: at a thousand results a second that was a tenth of this
        # thread). Workers are watched by descriptor, each with itself as the key's data; the
        # set is synced only when a worker was replaced.
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r.fileno(), selectors.EVENT_READ, None)
            watched: dict[int, int] = {}  # id(worker) -> its descriptor
            while not self._dispatch():
                current = {id(w): w for w in self._workers}  # idle ones too: they may die
                if current.keys() != watched.keys():
                    for key in watched.keys() - current.keys():  # replaced (closed): drop it
                        sel.unregister(watched.pop(key))
                    for key in current.keys() - watched.keys():
                        watched[key] = current[key].conn.fileno()
                        sel.register(watched[key], selectors.EVENT_READ, current[key])
                self._serve([k.data for k, _ in sel.select(self._wait_s())])

    def _wait_s(self) -> float | None:
        """How long the dispatcher may sleep: until the first running task's hard limit."""
        busy = [w for w in self._workers if w.chunk]
        return max(0.0, min(w.deadline for w in busy) - time.monotonic()) if busy else None

    def _serve(self, ready: list[_Worker | None]) -> None:
        """Read what the ready descriptors carry (None: the wake-up pipe; a worker: its answer),
        then replace every worker past its running task's hard limit."""
        for w in ready:
            if w is None:
                self._wake_r.recv_bytes()  # one wake-up; another one is seen by the next select
                # Read first, then cleared: a submit after this writes again, and the tasks
                # of those before it are pending already, for the _dispatch that follows.
                with self._lock:
                    self._woken = False
                continue
            if w in self._workers:  # still a worker (not replaced): an answer to read
                self._receive(w)
        now = time.monotonic()
        for w in list(self._workers):
            if w.chunk and now >= w.deadline:
                self._replace(
                    w,
                    "worker_timeout",
                    f"no result within the hard limit of {w.chunk[0].timeout_s:g} s; worker killed",
                )
