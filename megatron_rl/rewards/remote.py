"""A verifier pool that spans nodes: the local pool plus verifier servers, one drop-in for
:class:`VerifierPool` (the servers: :mod:`megatron_rl.rewards.remote_server`, started with
``megatron-rl verifier-server``; the wire format is described there).

:class:`VerifierFleet` is a :class:`VerifierPool` (its own local workers) that also sends the
built-in reward, :func:`~megatron_rl.rewards.compose.score` of ``(RewardInput, RewardConfig)``, to
servers; any other function runs locally. :func:`verifier_pool` builds what a run's
``reward`` section asks for: the plain pool when ``reward.remote`` is empty.

**Placement.** Each task of a ``submit_many`` goes where it waits least: the place with the lowest
(tasks outstanding + 1) / workers, the local pool counted like any server. (Comparing workers minus
outstanding instead would keep feeding a 2-worker local pool until its queue matched a 64-worker
server's free slots.) A server's tasks queue here until one of its ``streams`` threads -- a fixed
few per server, never one per task -- takes all that is queued for one reward config, up to
``_BATCH_TASKS`` / ``_BATCH_BYTES``, as one request, and settles each future as its answer
streams in. Several streams per server keep it busy while one request drains its tail. Every
network call has a timeout.

**A server lost mid-batch loses nothing.** A refused or reset connection, a read silent past
``read_timeout_s`` (servers send a heartbeat every 2 s), a 5xx, a stream that ends before its
``done`` line, or a request still unanswered past its tasks' bound (below): the tasks not yet
answered go to the local pool (or the least loaded live server), the server is marked down, and
its ``/health`` is asked again every ``probe_interval_s``. A 401, 400 or 404 is a setting or a
bug, not a loss: that request's futures fail with ``verifier_error`` naming the server and the
status, it is logged once and the server gets no more tasks (no retry loop). A 413 runs that
request's tasks here. Every future gets exactly one outcome.

**Deadline.** :meth:`VerifierFleet.deadline` stays an upper bound with tasks away: a server's
tasks end by its Graham bound (their limits spread over its workers, plus the longest, the
start-up and respawn allowances, as the local pool's) plus a network allowance (a connect, one
silent read, slack); a request still unanswered past that is given up as lost, and what a lost
server leaves runs here behind the local queue. So the bound is the latest such end plus the
local pool's own bound with those tasks added: never tighter than a local pool alone would
promise for the same work, and only reached when something is wedged.

    with VerifierFleet(["http://node7:8400"], 2, api_key=key) as pool:
        futures = pool.submit_many(score, [(inp, cfg), ...], timeout_s=[19.0, ...])
"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import logging
import math
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, TypeVar

from megatron_rl.errors import UsageError
from megatron_rl.rewards.compose import RewardConfig, RewardInput, score, split_verifier_url, verifier_warmup
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool
from megatron_rl.rewards.remote_server import LOCAL_ONLY
from megatron_rl.rewards.result import RewardResult

__all__ = ["VerifierFleet", "verifier_pool"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_CONNECT_TIMEOUT_S = 5.0
_READ_TIMEOUT_S = 30.0  # a server silent this long (15 heartbeats) is lost
_PROBE_S = 5.0  # a down server's /health is asked again this often
_STREAMS = 4  # requests in flight per server
_BATCH_TASKS = 256  # most tasks per request (a server takes 1024 by default)
_BATCH_BYTES = 16 << 20  # a request is cut past this much JSON (a server takes 64 MiB by default)
_REUSE_S = 20.0  # a connection idle longer is replaced (a server drops idle ones after 60 s)
# The deadline's allowances for a server: its pool may be (re)starting workers, and a respawn per
# task (the local pool's values); the network: a connect, one silent read, slack.
_SERVER_START_S = 30.0
_RESPAWN_S = 2.0
_NET_S = _CONNECT_TIMEOUT_S + _READ_TIMEOUT_S + 10.0
_MAX_LINE = 16 << 20
_INPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RewardInput))


def _input_json(inp: RewardInput) -> dict[str, Any]:
    # Shallow (dataclasses.asdict deep-copies every test and record): json.dumps walks it anyway.
    return {k: v for k in _INPUT_FIELDS if (v := getattr(inp, k)) is not None}


def _config_json(cfg: RewardConfig) -> bytes:
    d = dataclasses.asdict(cfg)
    for k in LOCAL_ONLY:
        d.pop(k, None)
    return json.dumps(d, sort_keys=True).encode()


def _result_from_json(obj: object) -> RewardResult:
    if not isinstance(obj, dict) or not isinstance(obj.get("reward"), (int, float)):
        raise ValueError(f"not a reward result: {str(obj)[:200]}")
    return RewardResult(
        float(obj["reward"]),
        dict(obj.get("parts") or {}),
        str(obj.get("reason", "ok")),
        str(obj.get("detail", "")),
        correct=bool(obj.get("correct")),
        format_ok=bool(obj.get("format_ok")),
        info=dict(obj.get("info") or {}),
    )


def _settle(f: Future, *, result: object = None, exc: BaseException | None = None) -> None:
    """Give ``f`` its outcome unless it has one already (a race with close): one each."""
    try:
        if exc is not None:
            f.set_exception(exc)
        else:
            f.set_result(result)
    except InvalidStateError:
        pass


def _drop(f: Future) -> None:
    if not f.cancel():  # sent already: it cannot be cancelled, it fails
        _settle(f, exc=PoolTaskError("cancelled", "the pool was closed"))


def _copy(to: Future, src: Future) -> None:
    """``src``'s outcome (a local re-run's) to ``to`` (the caller's future)."""
    if src.cancelled():
        _drop(to)
        return
    exc = src.exception()
    _settle(to, result=None if exc is not None else src.result(), exc=exc)


class _Lost(Exception):
    """A server that stopped answering: its unanswered tasks run elsewhere."""


@dataclass(eq=False)
class _Job:
    """A ``score`` task bound for a server: the caller's future and where it is counted now."""

    inp: RewardInput
    cfg: RewardConfig
    limit: float
    future: Future
    server: _Server | None = None  # None: answered, re-run locally, or dropped
    by: float = 0.0  # given up as lost when still unanswered then (time.monotonic())


@dataclass(eq=False)
class _Stream:
    conn: http.client.HTTPConnection | None = None
    used_at: float = 0.0
    inflight: dict[str, _Job] = field(default_factory=dict)  # request's task id -> job


@dataclass(eq=False)
class _Server:
    url: str
    host: str
    port: int
    cond: threading.Condition  # its streams wait here (on the fleet's lock)
    state: str = "probing"  # probing (not asked yet) | up | down | refused (a 4xx: never again)
    workers: int = 0
    why: str = ""
    next_probe: float = 0.0
    queue: deque[_Job] = field(default_factory=deque)
    n: int = 0  # tasks counted here: queued here, or sent and unanswered
    limits: Counter[float] = field(default_factory=Counter)
    limit_sum: float = 0.0
    streams: list[_Stream] = field(default_factory=list)

    def bound(self) -> float:
        """Seconds until everything counted here has an answer, if each task keeps its limit."""
        longest = max(self.limits) if self.n else 0.0
        spread = (self.limit_sum + _RESPAWN_S * self.n) / max(1, self.workers)
        return _NET_S + _SERVER_START_S + spread + longest + _RESPAWN_S


class VerifierFleet(VerifierPool):
    """The local pool plus verifier servers (see the module docstring): what a
    :class:`VerifierPool` offers -- ``submit``/``submit_many`` futures, ``map``, ``result``,
    ``deadline``, ``broken`` (the local pool's), ``wait_ready``, ``close(cancel=)`` -- with
    ``score`` tasks spread over the servers too. ``servers()`` and ``remote_stats`` tell how."""

    def __init__(
        self,
        urls: Sequence[str],
        num_workers: int = 2,
        *,
        api_key: str = "",
        streams: int = _STREAMS,
        read_timeout_s: float = _READ_TIMEOUT_S,
        probe_interval_s: float = _PROBE_S,
        local_share: bool = True,
        **pool_kwargs: Any,
    ):
        """``urls``: each server's ``http://HOST:PORT``; ``api_key``: sent to all of them;
        ``local_share``: False keeps ``score`` tasks off the local workers while a server is up
        (they are the fallback only: this node's cores stay with the orchestrator);
        ``pool_kwargs``: the local pool's (``default_timeout_s``, ``preload``, ``warmup``)."""
        where = []
        for i, url in enumerate(urls):
            try:
                where.append((url.rstrip("/"), *split_verifier_url(url)))
            except ValueError as e:
                raise UsageError(f"remote[{i}]: {e}") from None
        if not 1 <= streams <= 64:
            raise UsageError(f"streams: must be in [1, 64], got {streams}")
        super().__init__(num_workers, **pool_kwargs)
        # The servers' side lives apart: none of its names can shadow the pool's own.
        self._remotes = _Remotes(
            where,
            local_submit=functools.partial(VerifierPool.submit_many, self),
            local_broken=lambda: self.broken,
            local_workers=num_workers,
            local_share=local_share,
            api_key=api_key,
            streams=streams,
            read_timeout_s=read_timeout_s,
            probe_interval_s=probe_interval_s,
        )

    def submit_many(
        self,
        fn: Callable[..., T],
        items: Iterable[tuple],
        *,
        timeout_s: Sequence[float] | float | None = None,
    ) -> list[Future[T]]:
        """:meth:`VerifierPool.submit_many`; ``score(RewardInput, RewardConfig)`` tasks may run on
        a server (each where it waits least), anything else runs in the local pool."""
        items = list(items)
        limits = self.limits(timeout_s, len(items))
        remote_ok = fn is score and all(
            len(a) == 2 and isinstance(a[0], RewardInput) and isinstance(a[1], RewardConfig) for a in items
        )
        return self._remotes.submit(fn, items, limits, remote_ok)

    def deadline(self) -> float:
        """:meth:`VerifierPool.deadline` with the tasks away counted (see the module docstring)."""
        local = super().deadline()
        return self._remotes.deadline(local)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """The local workers started and every server answered ``/health`` once; True when all
        of them are up."""
        until = None if timeout_s is None else time.monotonic() + timeout_s
        ok = super().wait_ready(timeout_s)
        return self._remotes.wait_probed(until) and ok

    def servers(self) -> list[dict[str, object]]:
        """Each server's URL, state, workers, tasks counted there and why it is down."""
        return self._remotes.describe()

    @property
    def remote_stats(self) -> Counter[str]:
        """Tasks sent, answered, rerouted (run elsewhere after a loss), refused; servers lost."""
        return self._remotes.stats

    def close(self, *, cancel: bool = False) -> None:
        """Finish (with ``cancel``: drop) the tasks away, then close the local pool the same way."""
        self._remotes.close(cancel, drain_until=None if cancel else self.deadline())
        super().close(cancel=cancel)

    def __enter__(self) -> VerifierFleet:
        return self


class _Remotes:
    """The servers' side of a :class:`VerifierFleet`: placement, the stream threads, failover."""

    def __init__(
        self,
        where: list[tuple[str, str, int]],
        *,
        local_submit: Callable[..., list[Future]],
        local_broken: Callable[[], str | None],
        local_workers: int,
        local_share: bool,
        api_key: str,
        streams: int,
        read_timeout_s: float,
        probe_interval_s: float,
    ):
        self._local_submit = local_submit
        self._local_broken = local_broken
        self._local_workers = local_workers
        self._local_share = local_share
        self._api_key = api_key
        self._read_timeout_s = read_timeout_s
        self._probe_s = probe_interval_s
        # Re-entrant: a future's callbacks run where it ends, sometimes under this lock.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a probe ended, the servers emptied
        self._local_n = 0  # tasks handed to the local pool and not done
        self._latest_by = 0.0  # the latest bound of a task sent away
        self._closing = self._cancel = self._stop = False
        self._cfg_json: tuple[RewardConfig, bytes] | None = None
        self.stats: Counter[str] = Counter()
        self.servers = [_Server(url, h, p, threading.Condition(self._lock)) for url, h, p in where]
        self._threads: list[threading.Thread] = []
        for s in self.servers:
            s.streams = [_Stream() for _ in range(streams)]
            for k in range(streams):
                t = threading.Thread(
                    target=self._run_stream, args=(s, k), name=f"verifier-remote-{k}", daemon=True
                )
                t.start()
                self._threads.append(t)

    # -- the fleet's calls --------------------------------------------------------------------------
    def submit(self, fn: Callable, items: list[tuple], limits: list[float], remote_ok: bool) -> list[Future]:
        if not remote_ok or not self.servers:
            return self._submit_local(fn, items, limits)
        local_ok = self._local_broken() is None  # read before the lock (see _choose)
        with self._lock:
            if self._closing:
                raise RuntimeError("the verifier pool is closed")
            places = self._choose(len(items), local_ok)
        out: dict[int, Future] = {}
        mine = [i for i, p in enumerate(places) if p is None]
        if mine:
            out.update(zip(mine, self._submit_local(fn, [items[i] for i in mine], [limits[i] for i in mine])))
        jobs, targets = [], []
        for i, p in enumerate(places):
            if p is not None:
                job = _Job(items[i][0], items[i][1], limits[i], Future())
                job.future.add_done_callback(functools.partial(self._job_done, job))
                out[i] = job.future
                jobs.append(job)
                targets.append(p)
        self._enqueue_at(jobs, targets)
        return [out[i] for i in range(len(items))]

    def deadline(self, local: float) -> float:
        now = time.monotonic()
        with self._lock:
            away = [s for s in self.servers if s.n]
            if not away:
                return local
            end = max(self._latest_by, now + max(s.bound() for s in away))
            rerun = sum(s.limit_sum + _RESPAWN_S * s.n for s in away) / self._local_workers
            longest = max(max(s.limits) for s in away)
        return max(local, end + (local - now) + rerun + longest)

    def wait_probed(self, until: float | None) -> bool:
        with self._changed:
            self._changed.wait_for(
                lambda: all(s.state != "probing" for s in self.servers),
                None if until is None else max(0.0, until - time.monotonic()),
            )
            return all(s.state == "up" for s in self.servers)

    def describe(self) -> list[dict[str, object]]:
        with self._lock:
            return [
                {"url": s.url, "state": s.state, "workers": s.workers, "tasks": s.n, "why": s.why}
                for s in self.servers
            ]

    def close(self, cancel: bool, drain_until: float | None) -> None:
        with self._lock:
            self._closing = True
        if drain_until is not None:  # lost servers' tasks come back to the local pool, still open
            with self._changed:
                self._changed.wait_for(
                    lambda: not any(s.n for s in self.servers), max(0.0, drain_until - time.monotonic())
                )
        with self._lock:
            self._cancel = self._stop = True  # what is left now (cancel, or a wedged server) is dropped
            dropped = [j for s in self.servers for j in s.queue]
            dropped += [j for s in self.servers for st in s.streams for j in st.inflight.values()]
            conns = [st.conn for s in self.servers for st in s.streams if st.conn is not None]
            for s in self.servers:
                s.queue.clear()
                s.cond.notify_all()
        for job in dropped:
            _drop(job.future)
        for conn in conns:  # wakes a stream blocked in a read
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:  # anything a stream put back while it stopped
            left = [j for s in self.servers for j in s.queue]
            left += [j for s in self.servers for st in s.streams for j in st.inflight.values()]
        for job in left:
            _drop(job.future)

    # -- placement and counts (under the lock) ------------------------------------------------------
    def _choose(self, n: int, local_ok: bool, exclude: _Server | None = None) -> list[_Server | None]:
        """Where each of ``n`` tasks waits least: the lowest (outstanding + 1) / workers; None is
        the local pool, left out when it is broken (or not shared) and a server is up.
        ``local_ok`` is read before this lock is taken: the local pool holds its own lock where
        some of its futures end, and their callbacks take this one."""
        places: list[_Server | None] = [s for s in self.servers if s.state == "up" and s is not exclude]
        loads = [[float(s.n), float(s.workers)] for s in places if s is not None]
        if (local_ok and self._local_share) or not places:
            places.insert(0, None)
            loads.insert(0, [float(self._local_n), float(self._local_workers)])
        out = []
        for _ in range(n):
            k = min(range(len(loads)), key=lambda i: (loads[i][0] + 1) / loads[i][1])
            loads[k][0] += 1
            out.append(places[k])
        return out

    def _count(self, job: _Job, s: _Server | None) -> None:
        """Move ``job``'s count from where it is to ``s`` (None: nowhere)."""
        old = job.server
        if old is not None:
            old.n -= 1
            old.limit_sum = max(0.0, old.limit_sum - job.limit) if old.n else 0.0
            old.limits[job.limit] -= 1
            if old.limits[job.limit] <= 0:
                del old.limits[job.limit]
            if not any(x.n for x in self.servers):
                self._latest_by = 0.0
                self._changed.notify_all()
        job.server = s
        if s is not None:
            s.n += 1
            s.limit_sum += job.limit
            s.limits[job.limit] += 1
            job.by = time.monotonic() + s.bound()
            self._latest_by = max(self._latest_by, job.by)

    def _submit_local(self, fn: Callable, items: list[tuple], limits: list[float]) -> list[Future]:
        with self._lock:
            self._local_n += len(items)
        try:
            futures = self._local_submit(fn, items, timeout_s=limits)
        except BaseException:
            with self._lock:
                self._local_n -= len(items)
            raise
        for f in futures:
            f.add_done_callback(self._local_done)
        return futures

    def _local_done(self, _f: Future) -> None:
        with self._lock:
            self._local_n -= 1

    def _job_done(self, job: _Job, _f: Future) -> None:
        with self._lock:
            self._count(job, None)

    def _enqueue_at(self, jobs: list[_Job], places: list[_Server]) -> None:
        """Queue each job at its server; a server down since it was chosen sends its jobs on."""
        again = []
        with self._lock:
            for job, s in zip(jobs, places):
                if job.future.done():
                    continue
                if s.state != "up" or self._stop:
                    again.append(job)
                    continue
                self._count(job, s)
                s.queue.append(job)
            for s in set(places):
                s.cond.notify()
        if again:
            self._reroute(again, None, "its server went down before it was sent")

    def _reroute(self, jobs: list[_Job], lost: _Server | None, why: str) -> None:
        """Run unanswered ``jobs`` elsewhere: the local pool or the least loaded live server."""
        local_ok = self._local_broken() is None
        with self._lock:
            jobs = [j for j in jobs if not j.future.done()]
            if not jobs:
                return
            places = [] if self._cancel else self._choose(len(jobs), local_ok, exclude=lost)
            for j in jobs:
                self._count(j, None)
            self.stats["rerouted"] += len(places)
        if not places:  # closing with cancel
            for j in jobs:
                _drop(j.future)
            return
        here = [j for j, p in zip(jobs, places) if p is None]
        if here:
            try:
                futures = self._submit_local(score, [(j.inp, j.cfg) for j in here], [j.limit for j in here])
            except Exception as e:  # noqa: BLE001 -- the local pool is closed or broken: said per task
                for j in here:
                    _settle(
                        j.future,
                        exc=PoolTaskError("worker_crash", f"{why}, and the local pool refused it: {e}"),
                    )
            else:
                for j, f in zip(here, futures):
                    f.add_done_callback(functools.partial(_copy, j.future))
                    j.future.add_done_callback(functools.partial(_cancel_with, f))
        away = [(j, p) for j, p in zip(jobs, places) if p is not None]
        self._enqueue_at([j for j, _ in away], [p for _, p in away if p is not None])

    # -- the stream threads -------------------------------------------------------------------------
    def _run_stream(self, s: _Server, k: int) -> None:
        """Stream ``k`` of server ``s``: send what is queued there, read the answers; stream 0
        also asks a server that is not up for its ``/health``."""
        st = s.streams[k]
        while True:
            jobs: list[_Job] = []
            with self._lock:
                while True:
                    if self._stop:
                        if st.conn is not None:
                            st.conn.close()
                        return
                    if s.state == "up" and s.queue:
                        jobs = self._take(s)
                        if jobs:
                            break
                        continue
                    now = time.monotonic()
                    probing = k == 0 and s.state in ("probing", "down")
                    if probing and now >= s.next_probe:
                        break
                    s.cond.wait(s.next_probe - now if probing else None)
            try:
                if jobs:
                    self._exchange(s, st, jobs)
                else:
                    self._probe(s)
            except Exception as e:  # a bug here must not strand the tasks: they run elsewhere
                log.exception("verifier server %s: stream failed", s.url)
                self._down(s, st, f"{type(e).__name__}: {e}")

    def _take(self, s: _Server) -> list[_Job]:
        """The queued jobs of one reward config, in order, up to ``_BATCH_TASKS`` (under the lock)."""
        jobs: list[_Job] = []
        rest: list[_Job] = []
        while s.queue and len(jobs) < _BATCH_TASKS:
            job = s.queue.popleft()
            if job.future.done():  # cancelled by its caller while it waited here
                continue
            if jobs and job.cfg is not jobs[0].cfg:
                rest.append(job)
            elif job.future.running() or job.future.set_running_or_notify_cancel():
                jobs.append(job)
        s.queue.extendleft(reversed(rest))
        if s.queue:
            s.cond.notify()  # another stream takes the rest
        return jobs

    def _body(self, s: _Server, jobs: list[_Job]) -> tuple[bytes, list[_Job]]:
        """The request's JSON and the jobs in it: those past the size cut go back to the queue,
        those that are not JSON (a record holding other objects) run locally."""
        cfg = jobs[0].cfg
        cached = self._cfg_json
        if cached is None or cached[0] is not cfg:
            cached = self._cfg_json = (cfg, _config_json(cfg))
        parts: list[str] = []
        sent: list[_Job] = []
        bad: list[_Job] = []
        size = 0
        for i, job in enumerate(jobs):
            try:
                text = json.dumps(
                    {"id": str(len(sent)), "input": _input_json(job.inp), "timeout_s": job.limit}
                )
            except (TypeError, ValueError):
                bad.append(job)
                continue
            if sent and size + len(text) > _BATCH_BYTES:
                with self._lock:
                    s.queue.extendleft(reversed(jobs[i:]))
                    s.cond.notify()
                break
            parts.append(text)
            sent.append(job)
            size += len(text)
        if bad:
            self._reroute(bad, s, "its input is not JSON")
        return b'{"reward":' + cached[1] + b',"tasks":[' + ",".join(parts).encode() + b"]}", sent

    def _exchange(self, s: _Server, st: _Stream, jobs: list[_Job]) -> None:
        body, jobs = self._body(s, jobs)
        if not jobs:
            return
        with self._lock:
            cancel = self._cancel
            if not cancel:
                st.inflight = {str(i): j for i, j in enumerate(jobs)}
                self.stats["sent"] += len(jobs)
        if cancel:  # close() came between the take and now: dropped like the queue
            for j in jobs:
                _drop(j.future)
            return
        try:
            resp = self._request(st, s, body)
            if resp.status != 200:
                return self._refused(s, st, resp)
            self._read(s, st, resp)
            st.used_at = time.monotonic()
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, _Lost) as e:
            self._down(s, st, str(e) if isinstance(e, _Lost) else f"{type(e).__name__}: {e}")

    def _request(self, st: _Stream, s: _Server, body: bytes) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        for attempt in range(2):
            fresh = st.conn is None or time.monotonic() - st.used_at > _REUSE_S
            if st.conn is None or fresh:
                if st.conn is not None:
                    st.conn.close()
                    st.conn = None
                conn = http.client.HTTPConnection(s.host, s.port, timeout=_CONNECT_TIMEOUT_S)
                conn.connect()
                conn.timeout = self._read_timeout_s  # every read from now on
                if conn.sock is not None:
                    conn.sock.settimeout(self._read_timeout_s)
                st.conn = conn
            try:
                st.conn.request("POST", "/score", body=body, headers=headers)
                return st.conn.getresponse()
            except (ConnectionResetError, BrokenPipeError):  # RemoteDisconnected is one
                st.conn.close()
                st.conn = None
                if fresh or attempt:  # else a kept connection the server had dropped: retried once
                    raise
        raise AssertionError("unreachable")

    def _read(self, s: _Server, st: _Stream, resp: http.client.HTTPResponse) -> None:
        """Settle each job as its line arrives; _Lost when the stream ends early or overruns."""
        check_at = min(j.by for j in st.inflight.values())
        while True:
            line = resp.readline(_MAX_LINE)
            if not line.endswith(b"\n"):
                raise _Lost("its answer ended before every task was answered")
            if line.strip():
                msg = json.loads(line)
                if "done" in msg:
                    break
                with self._lock:
                    job = st.inflight.pop(msg["id"])
                    self.stats["answered"] += 1
                if not msg.get("ok"):
                    why = f"{msg.get('detail', '')} (on {s.url})"
                    _settle(job.future, exc=PoolTaskError(str(msg.get("reason", "verifier_error")), why))
                else:
                    try:
                        _settle(job.future, result=_result_from_json(msg.get("result")))
                    except ValueError as e:
                        _settle(job.future, exc=PoolTaskError("verifier_error", f"{s.url} answered {e}"))
            now = time.monotonic()
            if now >= check_at:
                with self._lock:
                    check_at = min((j.by for j in st.inflight.values()), default=math.inf)
                if now >= check_at:
                    raise _Lost("no answer within its tasks' bound")
        resp.read()  # the last chunk: the connection can carry the next request
        if st.inflight:
            raise _Lost(f"{len(st.inflight)} tasks were not answered")

    def _refused(self, s: _Server, st: _Stream, resp: http.client.HTTPResponse) -> None:
        try:
            text = resp.read(65536).decode(errors="replace")
            message = str(json.loads(text).get("error", text))
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            message = ""
        if st.conn is not None:
            st.conn.close()
            st.conn = None
        if resp.status >= 500:
            return self._down(s, st, f"HTTP {resp.status} {message}".strip())
        with self._lock:
            jobs, st.inflight = list(st.inflight.values()), {}
        if resp.status == 413:  # too big for it: these run here, the server stays in use
            log.warning(
                "verifier server %s refused a request as too large (%s): it runs here", s.url, message
            )
            return self._reroute(jobs, s, f"{s.url} refused it as too large")
        why = f"verifier server {s.url} answered {resp.status} {resp.reason}: {message}"
        if resp.status in (401, 403):
            why += " (its API key: the variable reward.remote_api_key_env names)"
        with self._lock:
            first = s.state != "refused"
            s.state, s.why = "refused", why
            queued = list(s.queue)
            s.queue.clear()
            self.stats["refused"] += len(jobs)
            self._changed.notify_all()
        if first:
            log.error("%s; it gets no more tasks", why)
        for job in jobs:
            _settle(job.future, exc=PoolTaskError("verifier_error", why))
        self._reroute(queued, s, why)

    def _down(self, s: _Server, st: _Stream, why: str) -> None:
        """``s`` stopped answering: this stream's unanswered jobs and its queue run elsewhere."""
        if st.conn is not None:
            st.conn.close()
            st.conn = None
        with self._lock:
            jobs = list(st.inflight.values()) + list(s.queue)
            st.inflight = {}
            s.queue.clear()
            was = s.state
            if was == "up":
                s.state, s.why = "down", why
                s.next_probe = time.monotonic() + self._probe_s
                self.stats["lost"] += 1
                s.cond.notify_all()  # stream 0 asks its /health from now on
            cancel = self._cancel
        if was == "up" and not cancel:
            log.warning(
                "verifier server %s lost (%s): %d tasks run elsewhere; asking its /health every %g s",
                s.url,
                why,
                len(jobs),
                self._probe_s,
            )
        self._reroute(jobs, s, f"verifier server {s.url} was lost ({why})")

    def _probe(self, s: _Server) -> None:
        conn = http.client.HTTPConnection(s.host, s.port, timeout=_CONNECT_TIMEOUT_S)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            health = json.loads(resp.read(65536)) if resp.status == 200 else {}
            workers = health.get("workers") if isinstance(health, dict) else None
            if not isinstance(workers, int) or workers < 1:
                raise _Lost(f"/health answered {resp.status}, not as a verifier server does")
            if health.get("broken"):
                raise _Lost(f"its pool is broken: {health['broken']}")
        except (OSError, http.client.HTTPException, ValueError, _Lost) as e:
            with self._lock:
                first = s.state == "probing"
                s.state, s.why = "down", str(e) if isinstance(e, _Lost) else f"{type(e).__name__}: {e}"
                s.next_probe = time.monotonic() + self._probe_s
                self._changed.notify_all()
            if first:
                log.warning(
                    "verifier server %s is not answering (%s); asking every %g s", s.url, s.why, self._probe_s
                )
            return
        finally:
            conn.close()
        with self._lock:
            back = s.state == "down"
            s.state, s.workers, s.why = "up", workers, ""
            self._changed.notify_all()
        if back:
            log.warning("verifier server %s is back (%d workers)", s.url, workers)


def _cancel_with(local: Future, mine: Future) -> None:
    if mine.cancelled():  # its caller cancelled it: the local re-run need not run either
        local.cancel()


def verifier_pool(cfg: RewardConfig) -> VerifierPool:
    """The pool a run scores in: a :class:`VerifierPool` of ``cfg.workers``, or with
    ``cfg.remote`` a :class:`VerifierFleet` of those plus the servers (the API key from the
    variable ``cfg.remote_api_key_env`` names, when set)."""
    if not cfg.remote:
        return VerifierPool(cfg.workers, warmup=verifier_warmup(cfg))
    key = os.environ.get(cfg.remote_api_key_env, "") if cfg.remote_api_key_env else ""
    return VerifierFleet(cfg.remote, cfg.workers, api_key=key, warmup=verifier_warmup(cfg))
