"""A client for a fleet of servers that speak SGLang's HTTP API (SGLang 0.5.23, or the built-in
``megatron-rl serve-engine``); payloads in ``generation/protocol.py``.

    fleet = FleetClient(["http://10.0.0.1:30000", "http://10.0.0.2:30000"])
    for result in fleet.generate(requests):      # yields each completion as it finishes
        ...
    future = fleet.submit(request)               # or one at a time
    future = fleet.submit_batch(group)           # or a group's G samples in one (the RL loop does)

**Routing.** Each request goes to the live server with the fewest requests in flight relative to
its KV capacity (``max_total_num_tokens`` from ``/server_info``): the client's own
least-loaded routing. A batch (:meth:`FleetClient.submit_batch`) goes to one server as one
``/generate``: the control plane's cost then grows with the groups, not the samples (one HTTP
request, one JSON body, one callback per group), and the server prefills the group's prompt once.
With sglang-router in front of the servers, give the router's single URL instead; the router
balances and the client sees one server (weight updates then go to the servers themselves: pass
``update_urls``).

**Two paths that never wait on each other.** Generation requests run on one event loop
(:mod:`asyncio` + ``aiohttp``, a thread of the client's own): thousands in flight cost a socket
each, not a thread, as in slime's and AReaL's rollout clients. Control calls (pause, resume,
begin/end update, update weights, abort, server info) run on a small thread pool of their own
with their own connections (kept alive between calls: an update's pause, update and resume reach
each server within milliseconds), so a weight update never queues behind generations, whatever the
number in flight. A batch's ``on_results`` callback runs on the event loop's thread as each
reply is read (a hand-over to another thread per completion was a quarter of the orchestrator's
CPU at thousands in flight), so it must be quick; a future's own callbacks run on a third set
of threads when there is no ``on_results``, so a slow one never stalls the event loop.

**Timeouts.** Every call has a connect timeout (``connect_timeout_s``) and a finite read
timeout: ``request_timeout_s`` for a generation (generous: long reasoning traces are normal) and
``control_timeout_s`` for control calls. A generation that runs past its timeout is aborted on
its server (``/abort_request`` with its id) and comes back as a result with
``finish_reason == "abort"`` and ``meta["timed_out"]``, counted in :attr:`FleetClient.timed_out`:
the caller re-issues it (the RL loop does, as it does every aborted request) or scores it
``abort``; it is never silently lost.

**Lost requests.** If a server dies (connection refused, reset, or closed mid-reply), every
request in flight there fails with :class:`ServerLost`, the server is marked dead and taken out
of routing, and the loss is recorded in :attr:`FleetClient.lost` as ``(request_id, url)``.
:meth:`generate` re-sends lost requests to another live server (``resend_lost=True``, the
default) or raises; :meth:`submit` leaves the choice to the caller.
:meth:`FleetClient.revive` (or :meth:`refresh`) puts a restarted server back.

**Weight updates** (the trainer's broadcaster drives them): :meth:`pause`, :meth:`begin_update`,
:meth:`update_weights_async` (every server joins the broadcast that follows), :meth:`end_update`,
:meth:`resume`; :meth:`init_update_group_async` joins every server to the update group with
consecutive ranks after the trainer's rank 0.

**API key.** ``api_key`` (default: ``$MEGATRON_RL_API_KEY``; "" for none) goes with every request
as ``Authorization: Bearer KEY``, the header SGLang's and the built-in engine's ``--api-key``
want. A server that refuses the key (401) raises :class:`ServerError` from :meth:`refresh`: a
wrong key is a configuration error, not a dead server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import aiohttp
import orjson

from megatron_rl.generation.api import GenRequest, GenResult
from megatron_rl.generation.engine.weights import ENGINE_CAPABILITY, STREAM_ROUTE
from megatron_rl.generation.protocol import (
    FLAT_LOGPROBS,
    STREAMED_BATCH,
    ProtocolError,
    abort_payload,
    api_key_from_env,
    auth_headers,
    check_api_key,
    generate_batch_payload,
    generate_payload,
    init_group_payload,
    memory_payload,
    parse_generate,
    parse_generate_batch,
    parse_stream_events,
    parse_weights_checker,
    pause_payload,
    update_group_ranks,
    update_weights_from_tensor_payload,
    weights_checker_payload,
)
from megatron_rl.generation.transport import (
    ClientClosed,
    Connections,
    ServerError,
    ServerLost,
    Sink,
    parse_json,
    post_json,
    settle,
)

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["ClientClosed", "FleetClient", "ServerError", "ServerLost", "ServerState"]

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    url: str
    alive: bool = True  # routed: takes generations
    held: bool = False  # back after a death, not routed until the trainer's weights reach it (admit)
    held_since: float = 0.0  # time.monotonic() of the latest hold(): an update begun before it missed it
    in_flight: int = 0
    capacity_tokens: int = 0
    max_running: int = 0
    tp_size: int = 1
    info: dict[str, JsonValue] | None = None


# The loop's own short calls: a health probe after a lost connection, the abort of a timed-out
# request. They use a session of their own, so a full generation connection pool never delays them.
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


def _flat(server: ServerState) -> bool:
    """Whether ``server`` answers log-probs as one list of floats when asked (its
    ``/server_info`` says :data:`~megatron_rl.generation.protocol.FLAT_LOGPROBS`)."""
    return bool(server.info and server.info.get(FLAT_LOGPROBS))


class FleetClient:
    """Least-loaded routing over SGLang-API servers; see the module docstring."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        update_urls: Iterable[str] | None = None,
        request_timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 600.0,
        initial_version: int = 0,
        max_connections: int = 0,
        api_key: str | None = None,
        deterministic: bool = False,
    ) -> None:
        """``max_connections``: generation connections open at once over the whole fleet (each
        request in flight holds one; 0: no limit). The timeouts are in seconds, finite, > 0.
        ``deterministic``: refuse (:class:`ProtocolError`) a server whose ``/server_info`` says
        it runs without ``--enable-deterministic-inference`` (SGLang ignores request seeds
        then); the built-in engine does not report the flag: it always samples from the seed."""
        for name, value in (
            ("request_timeout_s", request_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("control_timeout_s", control_timeout_s),
        ):
            if not 0 < value < float("inf"):  # also refuses NaN
                raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value!r}")
        if max_connections < 0:
            raise ValueError(f"max_connections: must be >= 0 (0: no limit), got {max_connections}")
        # Not an attribute that reprs or logs would show; every request goes through _call.
        self._api_key = api_key_from_env() if api_key is None else check_api_key(api_key)
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        if not self.servers:
            raise ValueError("urls: need at least one server")
        self.update_urls = [u.rstrip("/") for u in (update_urls or [s.url for s in self.servers])]
        self.all_update_urls = list(self.update_urls)  # update_urls: the current group's members
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.initial_version = initial_version
        self.deterministic = deterministic
        self.lost: list[tuple[str, str]] = []  # (request_id, server url), in order of loss
        self.timed_out: list[tuple[str, str]] = []  # (request_id, server url): aborted there
        self._lock = threading.Lock()
        self._update_capacity = 0
        self._update_tp: dict[str, int] = {}
        self._closed = False
        # Control calls: a thread each, enough for one call to every server at once (an update
        # holds one per target while the broadcast runs) with room to spare.
        n_urls = len({s.url for s in self.servers} | set(self.update_urls))
        self._control = ThreadPoolExecutor(max_workers=2 * n_urls + 8, thread_name_prefix="fleet-control")
        self._connections = Connections()  # kept alive between control calls (transport.Connections)
        # Futures without on_results are settled here, off the event loop (their callbacks may block).
        self._deliver = ThreadPoolExecutor(max_workers=8, thread_name_prefix="fleet-callback")
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="fleet-io", daemon=True)
        self._io.start()
        self._session, self._aux = asyncio.run_coroutine_threadsafe(
            self._open_sessions(max_connections), self._loop
        ).result()
        self._probes: dict[str, asyncio.Task[bool]] = {}  # touched on the event loop only
        self._tasks: set[asyncio.Task[list[GenResult]]] = set()  # touched on the event loop only
        try:
            self.refresh()
        except BaseException:
            self.close()
            raise

    async def _open_sessions(
        self, max_connections: int
    ) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
        """The generation session, and the loop's own for probes and aborts."""
        headers = auth_headers(self._api_key)
        generation = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0),
            headers=headers,
            # The read timeout of a generation is its whole duration: tokens come back at the end.
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
            # SGLang's replies are JSON whatever their Content-Type; parse them ourselves.
            raise_for_status=False,
        )
        aux = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=headers, raise_for_status=False
        )
        return generation, aux

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        url: str,
        route: str,
        body: object,
        *,
        method: str = "POST",
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> JsonValue:
        """:func:`~megatron_rl.generation.transport.post_json` with this client's API key."""
        return post_json(
            url,
            route,
            body,
            method=method,
            timeout=timeout,
            request_id=request_id,
            api_key=self._api_key,
            connections=self._connections,
        )

    # ------------------------------------------------------------------ fleet state

    def refresh(self) -> None:
        """Re-read every server's ``/server_info``; unreachable servers are marked dead.

        A URL that answers but has no ``/server_info`` (a router) stays alive; its KV capacity
        is then that of the update targets behind it."""
        for s in self.servers:
            if not s.alive and not s.held:  # dead: back only through hold() (fleet_health.py)
                continue
            try:
                info = self._call(s.url, "/server_info", None, method="GET", timeout=self.control_timeout_s)
            except ServerLost:
                s.alive = s.held = False
                continue
            except ServerError as e:
                if e.status == 401:  # it answers, but not to this key: no point routing to it
                    raise
                answers = self._answers(s.url)
                s.alive, s.held, s.info = s.alive and answers, s.held and answers, None
                continue
            self._check_server(s.url, info)
            s.info = info
            s.capacity_tokens = int(info.get("max_total_num_tokens") or 0)
            s.max_running = int(info.get("max_running_requests") or 0)
            s.tp_size = update_group_ranks(info, s.url)
        self._update_capacity = 0
        routed = {s.url for s in self.servers}
        for u in self.update_urls:
            if u in routed:
                continue
            try:
                info = self._call(u, "/server_info", None, method="GET", timeout=self.control_timeout_s)
                self._check_server(u, info)
                self._update_capacity += int(info.get("max_total_num_tokens") or 0)
                self._update_tp[u] = update_group_ranks(info, u)
            except ServerError as e:
                if e.status == 401:
                    raise
            except ServerLost:
                pass

    def _check_server(self, url: str, info: dict[str, JsonValue]) -> None:
        """Refuse a server whose settings contradict the client's (see ``deterministic``)."""
        if self.deterministic and info.get("enable_deterministic_inference") is False:
            raise ProtocolError(
                f"{url}: fleet.deterministic is true, but this server runs without "
                "--enable-deterministic-inference, so it ignores the requests' sampling seeds; "
                "restart it with the flags `megatron-rl sglang-args server RECIPE` prints"
            )

    def revive(self, url: str) -> bool:
        """Put a (restarted) server back into routing if it answers; return whether it did."""
        for s in self.servers:
            if s.url == url.rstrip("/"):
                s.alive = True
                self.refresh()
                return s.alive
        raise KeyError(f"{url}: not a server of this fleet")

    def mark_dead(self, url: str) -> None:
        """Take a server out of routing (its process was seen dead)."""
        with self._lock:
            for s in self.servers:
                if s.url == url.rstrip("/"):
                    s.alive = s.held = False

    def hold(self, url: str) -> None:
        """A dead server answers again: it joins the next weight update, not routing (it holds
        weights of no version the trainer has now); :meth:`admit` routes it after the update."""
        with self._lock:
            for s in self.servers:
                if s.url == url.rstrip("/") and not s.alive:
                    s.held, s.held_since = True, time.monotonic()

    def held_urls(self) -> list[str]:
        return [s.url for s in self.servers if s.held]

    def admit(self, urls: Iterable[str], *, held_before: float) -> None:
        """Route these held servers again: the trainer's current weights reached them. Only
        those held before ``held_before`` (``time.monotonic()`` when the update that reached them
        began): one that died and came back during it has the old weights again."""
        wanted = {u.rstrip("/") for u in urls}
        with self._lock:
            for s in self.servers:
                if s.url in wanted and s.held and s.held_since <= held_before:
                    s.alive, s.held = True, False

    def _answers(self, url: str) -> bool:
        try:
            self._call(url, "/health", None, method="GET", timeout=5.0)
            return True
        except (ServerLost, ServerError):
            return False

    @property
    def alive(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive]

    def capacity_tokens(self) -> int:
        """KV capacity of the live servers together (behind a router: of the update targets),
        in tokens; 0 when unknown."""
        return sum(s.capacity_tokens for s in self.alive) + self._update_capacity

    def streams_batches(self) -> bool:
        """Whether every live server streams a batch's results back as each finishes (the
        built-in engine's ``/server_info`` says :data:`~megatron_rl.generation.protocol.STREAMED_BATCH`;
        SGLang's answers a batch whole). False with no live server."""
        live = self.alive
        return bool(live) and all(bool(s.info and s.info.get(STREAMED_BATCH)) for s in live)

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def _pick(self, exclude: frozenset[str] | set[str] = frozenset(), n: int = 1) -> ServerState:
        """The live server (not in ``exclude`` where there is another) with the fewest requests
        in flight for its KV capacity once it takes ``n`` more; counted as taken."""
        with self._lock:
            live = [s for s in self.servers if s.alive and s.url not in exclude] or [
                s for s in self.servers if s.alive
            ]
            if not live:
                raise ServerLost(
                    ",".join(s.url for s in self.servers),
                    None,
                    ConnectionError("no live server in the fleet"),
                )
            best = min(live, key=lambda s: (s.in_flight + n) / max(s.capacity_tokens, 1))
            best.in_flight += n
            return best

    # ------------------------------------------------------------------ generation

    def submit(
        self, req: GenRequest, *, url: str | None = None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> Future[GenResult]:
        """Send one request (to ``url``, or the least-loaded live server not in ``exclude``).

        The future fails with :class:`ServerLost` if its server dies (recorded in :attr:`lost`),
        or :class:`ServerError` if the server refuses it; a request that runs past
        ``request_timeout_s`` is aborted there and its result has ``finish_reason == "abort"``.
        Its callbacks run on the client's callback threads.
        """
        out: Future[GenResult] = Future()
        self._send([req], out, url=url, exclude=exclude, batch=False)
        return out

    def submit_batch(
        self,
        reqs: Sequence[GenRequest],
        *,
        url: str | None = None,
        exclude: frozenset[str] | set[str] = frozenset(),
        on_results: Callable[[list[GenResult]], None] | None = None,
    ) -> Future[list[GenResult]]:
        """Send several requests (a group's G samples) to one server in one ``/generate``
        (:func:`~megatron_rl.generation.protocol.generate_batch_payload`): one HTTP request and
        one connection for all of them, and the server prefills their shared prompt once. The
        future's results are in the order of ``reqs``; it fails as :meth:`submit`'s does, and
        past ``request_timeout_s`` every request not yet back is aborted there and comes back
        ``abort`` with ``meta["timed_out"]``.

        ``on_results``: each result is also handed to it as soon as it is known, every one
        exactly once, in calls that never overlap and that all come before the future settles
        (then the future's callbacks run on the same thread). It is called on the client's I/O
        thread, where replies are read (no hand-over to another thread per completion): it must
        be quick and must not wait on the fleet (submitting more is fine).
        Where the server streams a batch (the built-in engine's ``/server_info`` says
        :data:`~megatron_rl.generation.protocol.STREAMED_BATCH`), that is as each request
        finishes, so a group's short samples free their slots (and are scored) while its long
        ones decode; elsewhere, all at once with the reply. If the server is lost mid-stream,
        the results handed out are final and the future fails with :class:`ServerLost` for
        the rest (what they are is the caller's to see: those it was not given)."""
        if not reqs:
            raise ValueError("submit_batch: need at least one request")
        out: Future[list[GenResult]] = Future()
        self._send(list(reqs), out, url=url, exclude=exclude, batch=True, on_results=on_results)
        return out

    def _send(
        self,
        reqs: list[GenRequest],
        out: Future,
        *,
        url: str | None,
        exclude: frozenset[str] | set[str],
        batch: bool,
        on_results: Callable[[list[GenResult]], None] | None = None,
    ) -> None:
        if self._closed:
            raise ClientClosed("FleetClient: closed")
        if url is None:
            server = self._pick(exclude, len(reqs))
        else:
            named = [s for s in self.servers if s.url == url.rstrip("/")]
            if not named:
                raise KeyError(f"{url}: not a server of this fleet")
            server = named[0]
            with self._lock:
                server.in_flight += len(reqs)
        out.set_running_or_notify_cancel()  # running from now on: it cannot be cancelled
        sink = None if on_results is None else Sink(on_results)
        self._loop.call_soon_threadsafe(self._start, server, reqs, out, batch, sink)

    def _start(
        self, server: ServerState, reqs: list[GenRequest], out: Future, batch: bool, sink: Sink | None
    ) -> None:
        """On the event loop: run the request(s); hand the outcome to ``out`` off the loop."""
        stream = sink is not None and len(reqs) > 1 and bool(server.info and server.info.get(STREAMED_BATCH))
        task = self._loop.create_task(
            self._run_stream(server, reqs, sink) if stream and sink else self._run(server, reqs, batch)
        )
        self._tasks.add(task)

        def done(t: asyncio.Task[list[GenResult]]) -> None:
            self._tasks.discard(t)
            if sink is not None:  # after every result it was given, in order
                sink.finish(out, t)
                return
            try:
                self._deliver.submit(settle, out, t, batch)
            except RuntimeError:  # closing: the callback threads are gone, settle it here
                settle(out, t, batch)

        task.add_done_callback(done)

    async def _run_stream(self, server: ServerState, reqs: list[GenRequest], sink: Sink) -> list[GenResult]:
        """A batch as a stream (the server says it streams finished items only): each result
        goes to ``sink`` as its event arrives, but the last ones, which :meth:`Sink.finish`
        hands over once the stream's end is read and its connection back in the pool (the
        built-in engine sends them in one write with the end): what they free is the next
        request's, which then takes that connection instead of opening one. Returns them all in
        request order."""
        results: list[GenResult | None] = [None] * len(reqs)
        pending = set(range(len(reqs)))
        try:
            try:
                async with self._session.post(
                    server.url + "/generate",
                    data=orjson.dumps(generate_batch_payload(reqs, stream=True, flat_logprobs=_flat(server))),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    if resp.status != 200:
                        raise ServerError(server.url, "/generate", resp.status, parse_json(await resp.read()))
                    buf, finished = b"", False
                    async for chunk in resp.content.iter_any():
                        buf += chunk
                        cut = buf.rfind(b"\n\n")
                        if cut < 0:
                            continue
                        events, buf = buf[: cut + 2], buf[cut + 2 :]
                        items, end = parse_stream_events(
                            reqs, events, server=server.url, initial_version=self.initial_version
                        )
                        finished = finished or end
                        fresh = [r for i, r in items if i in pending]
                        for i, r in items:
                            if i in pending:
                                pending.discard(i)
                                results[i] = r
                        if fresh:
                            with self._lock:
                                server.in_flight -= len(fresh)
                            if pending:
                                sink.put(fresh)
                    if pending:  # the stream ended without them: the server went away mid-reply
                        raise aiohttp.ClientPayloadError(
                            f"the stream ended{' ([DONE])' if finished else ''} with {len(pending)} "
                            f"of {len(reqs)} requests unanswered"
                        )
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                late = sorted(pending)
                for i, r in zip(late, await self._failed(server, [reqs[i] for i in late], e)):
                    results[i] = r
                pending.clear()
        finally:
            with self._lock:
                server.in_flight -= len(pending)
        return [r for r in results if r is not None]

    async def _run(self, server: ServerState, reqs: list[GenRequest], batch: bool) -> list[GenResult]:
        body = (
            generate_batch_payload(reqs, flat_logprobs=_flat(server)) if batch else generate_payload(reqs[0])
        )
        try:
            try:
                async with self._session.post(
                    server.url + "/generate",
                    data=orjson.dumps(body),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    status, raw = resp.status, await resp.read()
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                return await self._failed(server, reqs, e)
        finally:
            with self._lock:
                server.in_flight -= len(reqs)
        payload = parse_json(raw)
        if status != 200:
            raise ServerError(server.url, "/generate", status, payload)
        if batch:
            return parse_generate_batch(
                reqs, payload, server=server.url, initial_version=self.initial_version
            )
        if not isinstance(payload, dict):
            raise ProtocolError(f"/generate reply from {server.url} is not a JSON object")
        return [parse_generate(reqs[0], payload, server=server.url, initial_version=self.initial_version)]

    async def _failed(self, server: ServerState, reqs: list[GenRequest], e: BaseException) -> list[GenResult]:
        """Requests ``reqs`` to ``server`` failed with ``e``: past their timeout, each is aborted
        there and returned ``abort`` with ``meta["timed_out"]``; any other failure (a connect
        timeout included: never connected, nothing to abort) raises :class:`ServerLost`."""
        # aiohttp's total timeout is asyncio.TimeoutError, i.e. TimeoutError; its connect
        # timeout is a TimeoutError too, but the request never reached the server.
        if isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError):
            return await self._timed_out(server, reqs)
        await self._lost(server, reqs, e)

    async def _lost(self, server: ServerState, reqs: list[GenRequest], cause: BaseException) -> NoReturn:
        """Record requests whose server went away and raise :class:`ServerLost`; a reset
        connection is not always a dead server, so ask it before taking it out of routing."""
        alive = await self._probe(server)
        with self._lock:
            server.alive = server.alive and alive
            self.lost.extend((r.request_id, server.url) for r in reqs)
        raise ServerLost(server.url, reqs[0].request_id, cause) from cause

    async def _probe(self, server: ServerState) -> bool:
        """Whether ``server`` answers ``/health``: one probe at a time per server, shared by
        every request that lost its connection there (a thousand lost at once ask once)."""
        if not server.alive:
            return False
        probe = self._probes.get(server.url)
        if probe is None:

            async def ask() -> bool:
                try:
                    async with self._aux.get(server.url + "/health", timeout=_PROBE_TIMEOUT) as resp:
                        await resp.read()
                        return resp.status == 200
                except (aiohttp.ClientError, OSError, TimeoutError):
                    return False
                finally:
                    self._probes.pop(server.url, None)

            probe = self._probes[server.url] = self._loop.create_task(ask())
        return await asyncio.shield(probe)

    async def _timed_out(self, server: ServerState, reqs: list[GenRequest]) -> list[GenResult]:
        """Abort requests that ran past ``request_timeout_s`` on their server (best effort: a
        server that does not answer either is found out by its next request)."""
        with self._lock:
            self.timed_out.extend((r.request_id, server.url) for r in reqs)

        async def abort_at(url: str, rid: str) -> None:
            try:
                async with self._aux.post(
                    url + "/abort_request",
                    data=json.dumps(abort_payload(rid)).encode(),
                    headers={"Content-Type": "application/json"},
                    timeout=_ABORT_TIMEOUT,
                ) as resp:
                    await resp.read()
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass

        await asyncio.gather(*(abort_at(u, r.request_id) for u in self._abort_urls(server) for r in reqs))
        return [
            GenResult(
                request_id=req.request_id,
                prompt_ids=list(req.input_ids),
                token_ids=[],
                logprobs=[],
                versions=[],
                finish_reason="abort",
                server=server.url,
                meta={"timed_out": True, "timeout_s": self.request_timeout_s},
            )
            for req in reqs
        ]

    def generate(self, requests: Iterable[GenRequest], *, resend_lost: bool = True) -> Iterator[GenResult]:
        """Yield a result per request as each finishes; lost requests are re-sent elsewhere
        (``resend_lost``) or raise :class:`ServerLost`."""
        pending: dict[Future[GenResult], tuple[GenRequest, set[str]]] = {}
        for r in requests:
            pending[self.submit(r)] = (r, set())
        while pending:
            done, _ = wait(list(pending), return_when="FIRST_COMPLETED")
            for fut in done:
                req, tried = pending.pop(fut)
                try:
                    yield fut.result()
                except ServerLost as e:
                    if not resend_lost:
                        raise
                    tried = tried | {e.url}
                    pending[self.submit(req, exclude=tried)] = (req, tried)

    def abort(self, request_id: str | None = None) -> None:
        """Abort one request (every server is asked) or all of them; behind a router, its
        workers are asked (the router has no ``/abort_request``)."""
        urls = sorted({u for s in self.alive for u in self._abort_urls(s)})
        self._broadcast_control("/abort_request", abort_payload(request_id), urls)

    def _abort_urls(self, server: ServerState) -> list[str]:
        """Where an abort of a request sent to ``server`` must go: the server itself, or, when
        it is a router (it answers but has no ``/server_info``; sglang-router forwards only
        generation), every update target behind it."""
        if server.info is None and server.alive:
            behind = [u for u in self.update_urls if u != server.url]
            if behind:
                return behind
        return [server.url]

    # ------------------------------------------------------------------ weight updates

    def _broadcast_control(self, route: str, body: object, urls: list[str] | None = None) -> list[JsonValue]:
        urls = urls if urls is not None else [s.url for s in self.alive]
        futs = [
            self._control.submit(self._call, u, route, body, timeout=self.control_timeout_s) for u in urls
        ]
        return [f.result() for f in futs]

    def pause(self, mode: str = "in_place") -> None:
        """Pause every update target; ``in_place`` keeps running requests and their KV cache."""
        self._broadcast_control("/pause_generation", pause_payload(mode), self._live_update_urls())

    def pause_async(self, mode: str = "in_place") -> list[Future[JsonValue]]:
        """:meth:`pause` without waiting: one future per live update target."""
        body = pause_payload(mode)
        return [
            self._control.submit(self._call, u, "/pause_generation", body, timeout=self.control_timeout_s)
            for u in self._live_update_urls()
        ]

    def resume(self) -> None:
        self._broadcast_control("/continue_generation", {}, self._live_update_urls())

    def begin_update(self) -> None:
        self._broadcast_control("/begin_weight_update", {}, self._live_update_urls())

    def end_update(self) -> list[JsonValue]:
        """Close every live target's update session; returns their answers (a built-in engine
        that received a streamed update answers its outcome and timings there)."""
        return self._broadcast_control("/end_weight_update", {}, self._live_update_urls())

    def _live_update_urls(self) -> list[str]:
        dead = {s.url for s in self.servers if not s.alive and not s.held}
        return [u for u in self.update_urls if u not in dead]

    def live_update_urls(self) -> list[str]:
        """Update targets that answer (routed servers by their state, held ones included; others
        by ``/health``), out of every target the fleet was given."""
        routed = {s.url: s.alive or s.held for s in self.servers}
        return [
            u for u in self.all_update_urls if routed.get(u, None) or (u not in routed and self._answers(u))
        ]

    def update_ranks(self) -> dict[str, int]:
        """Rank offset of each update target in the update group (rank 0 is the trainer)."""
        tp = {**self._update_tp, **{s.url: s.tp_size for s in self.servers}}
        ranks: dict[str, int] = {}
        nxt = 1
        for u in self.update_urls:
            ranks[u] = nxt
            nxt += tp.get(u, 1)
        return ranks

    def update_world_size(self) -> int:
        tp = {**self._update_tp, **{s.url: s.tp_size for s in self.servers}}
        return 1 + sum(tp.get(u, 1) for u in self.update_urls)

    def init_update_group_async(
        self, *, master_address: str, master_port: int, group_name: str, backend: str
    ) -> list[Future[JsonValue]]:
        """Ask every update target to join the group; the futures complete once the trainer
        (rank 0) has joined too, so call this first, then join, then wait on them."""
        world = self.update_world_size()
        return [
            self._control.submit(
                self._call,
                u,
                "/init_weights_update_group",
                init_group_payload(
                    master_address=master_address,
                    master_port=master_port,
                    rank_offset=r,
                    world_size=world,
                    group_name=group_name,
                    backend=backend,
                ),
                timeout=self.control_timeout_s,
            )
            for u, r in self.update_ranks().items()
        ]

    def update_weights_async(self, payload: dict[str, object]) -> list[Future[JsonValue]]:
        """Post one ``/update_weights_from_distributed`` to every update target; they return
        after receiving the broadcast the caller makes next."""
        return [
            self._control.submit(
                self._call, u, "/update_weights_from_distributed", payload, timeout=self.control_timeout_s
            )
            for u in self.update_urls
        ]

    def update_weights_stream_async(self, payload: dict[str, object]) -> list[Future[JsonValue]]:
        """Post a whole update's manifest (``engine/weights.py``) to every update target; each
        answers once it is ready for the broadcasts, or refuses the manifest (nothing sent yet)."""
        return [
            self._control.submit(self._call, u, STREAM_ROUTE, payload, timeout=self.control_timeout_s)
            for u in self.update_urls
        ]

    def takes_streamed_updates(self) -> bool:
        """Whether every update target is a built-in engine that takes streamed weight updates
        (its ``/server_info`` says so; SGLang's does not)."""
        for u in self.update_urls:
            try:
                info = self.server_info(u)
            except (ServerLost, ServerError):
                return False
            if not isinstance(info, dict) or info.get(ENGINE_CAPABILITY) != STREAM_ROUTE:
                return False
        return True

    def server_info(self, url: str) -> dict[str, JsonValue]:
        return self._call(url, "/server_info", None, method="GET", timeout=self.control_timeout_s)

    def weights_digest(self, url: str) -> dict[str, str]:
        """sha256 per parameter (built-in engine's ``/megatron_rl/weights_digest`` extension)."""
        return self._call(
            url, "/megatron_rl/weights_digest", None, method="GET", timeout=self.control_timeout_s
        )

    def weights_checksums(self, url: str) -> dict[tuple[int, int], str]:
        """SGLang's own weight check (``/weights_checker``, action ``checksum``) of one server:
        a checksum per worker, keyed by ``(pp_rank, tp_rank)``."""
        body = self._call(url, "/weights_checker", weights_checker_payload(), timeout=self.control_timeout_s)
        return parse_weights_checker(body, url)

    def flush_cache(self) -> list[str]:
        """Ask every live update target to empty its prefix cache; the URLs that refused
        (SGLang flushes only when no request runs or waits)."""
        refused = []
        for u in self._live_update_urls():
            try:
                self._call(u, "/flush_cache", None, timeout=self.control_timeout_s)
            except ServerError:
                refused.append(u)
        return refused

    def destroy_update_group(self, group_name: str) -> None:
        """Ask every live update target to leave the group (best effort)."""
        for u in self._live_update_urls():
            try:
                self._call(
                    u,
                    "/destroy_weights_update_group",
                    {"group_name": group_name},
                    timeout=self.control_timeout_s,
                )
            except (ServerLost, ServerError):
                pass

    # ------------------------------------------------------------------ colocated mode

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Ask every live update target to free the memory of ``tags`` (``protocol.MEMORY_TAGS``;
        None: all) while the trainer uses the device; a server with requests running refuses."""
        self._broadcast_control("/release_memory_occupation", memory_payload(tags), self._live_update_urls())

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Ask every live update target to take the memory of ``tags`` (None: all) back."""
        self._broadcast_control("/resume_memory_occupation", memory_payload(tags), self._live_update_urls())

    def update_weights_from_tensor(self, serialized: str, *, weight_version: int) -> None:
        """Post one ``/update_weights_from_tensor`` to every live update target: ``serialized``
        (``protocol.serialize_named_tensors``) once per tensor-parallel rank of each, inside the
        session that :meth:`begin_update` opened."""
        tp = {**self._update_tp, **{s.url: s.tp_size for s in self.servers}}
        futs = [
            self._control.submit(
                self._call,
                u,
                "/update_weights_from_tensor",
                update_weights_from_tensor_payload(
                    [serialized] * tp.get(u, 1), weight_version=weight_version
                ),
                timeout=self.control_timeout_s,
            )
            for u in self._live_update_urls()
        ]
        for f in futs:
            f.result()

    def close(self) -> None:
        """Stop: requests still in flight fail with :class:`ServerLost` (their servers abort
        them when the connection closes); control calls under way are not waited for."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._io.join(timeout=30)
        self._deliver.shutdown(wait=True)  # every future handed out is settled by now
        self._control.shutdown(wait=False, cancel_futures=True)
        self._connections.close()

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()
        await self._aux.close()
