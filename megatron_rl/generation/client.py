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
with their own connections (:mod:`~megatron_rl.generation.fleet_control`), so a weight update
never queues behind generations, whatever the number in flight. A batch's ``on_results`` callback
runs on the event loop's thread as each reply is read (a hand-over to another thread per
completion was a quarter of the orchestrator's CPU at thousands in flight), so it must be quick;
a future's own callbacks run on a third set of threads when there is no ``on_results``, so a
slow one never stalls the event loop.

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

**Fleet state and control calls** (health, pause and resume, weight updates, memory) live in the
base class, :class:`~megatron_rl.generation.fleet_control.FleetControl`; this module adds the
generation path.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NoReturn

import aiohttp
import orjson

from megatron_rl.generation.api import GenRequest, GenResult
from megatron_rl.generation.fleet_control import FleetControl, ServerState, check_seconds
from megatron_rl.generation.protocol import (
    FLAT_LOGPROBS,
    STREAMED_BATCH,
    ProtocolError,
    abort_payload,
    auth_headers,
    generate_batch_payload,
    generate_payload,
    parse_generate,
    parse_generate_batch,
    parse_stream_events,
)
from megatron_rl.generation.transport import (
    ClientClosed,
    ServerError,
    ServerLost,
    Sink,
    parse_json,
    settle,
)

__all__ = ["ClientClosed", "FleetClient", "ServerError", "ServerLost"]

log = logging.getLogger(__name__)


# The loop's own short calls: a health probe after a lost connection, the abort of a timed-out
# request. They use a session of their own, so a full generation connection pool never delays them.
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


def _flat(server: ServerState) -> bool:
    """Whether ``server`` answers log-probs as one list of floats when asked (its
    ``/server_info`` says :data:`~megatron_rl.generation.protocol.FLAT_LOGPROBS`)."""
    return bool(server.info and server.info.get(FLAT_LOGPROBS))


class FleetClient(FleetControl):
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
        check_seconds("request_timeout_s", request_timeout_s)
        check_seconds("connect_timeout_s", connect_timeout_s)
        if max_connections < 0:
            raise ValueError(f"max_connections: must be >= 0 (0: no limit), got {max_connections}")
        super().__init__(
            urls,
            update_urls=update_urls,
            control_timeout_s=control_timeout_s,
            api_key=api_key,
            deterministic=deterministic,
        )
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.initial_version = initial_version
        self.lost: list[tuple[str, str]] = []  # (request_id, server url), in order of loss
        self.timed_out: list[tuple[str, str]] = []  # (request_id, server url): aborted there
        self._closed = False
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
        super().close()

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()
        await self._aux.close()
