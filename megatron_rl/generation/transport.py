"""The fleet client's transport, below :class:`~megatron_rl.generation.client.FleetClient`: its
errors (a lost server, a refusal, a closed client), the blocking JSON call that control routes
use, and the hand-over of a request's results to the caller's callbacks (:class:`Sink`: in
order, one call at a time, then the future)."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import logging
import threading
import urllib.parse
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from megatron_rl.generation.engine.weights import STREAM_ROUTE
from megatron_rl.generation.protocol import (
    API_KEY_ENV,
    ROUTES,
    SGLANG_VERSION,
    ProtocolError,
    auth_headers,
    loads_json,
)

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.api import GenResult

__all__ = ["ClientClosed", "ServerError", "ServerLost", "Sink", "parse_json", "post_json", "settle"]

log = logging.getLogger("megatron_rl.generation.client")


class ServerLost(ConnectionError):
    """The server went away with a request in flight."""

    def __init__(self, url: str, request_id: str | None, cause: BaseException):
        super().__init__(
            f"{url}: lost{' request ' + request_id if request_id else ''} ({type(cause).__name__}: {cause})"
        )
        self.url, self.request_id, self.cause = url, request_id, cause


class ClientClosed(RuntimeError):
    """:meth:`FleetClient.submit` after :meth:`FleetClient.close`."""


class ServerError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, route: str, status: int, body: JsonValue):
        message = (body.get("message") or body.get("error")) if isinstance(body, dict) else body
        if status == 401:
            message = f"{message} (a missing or wrong API key: FleetClient(api_key=...) or ${API_KEY_ENV})"
        super().__init__(f"{url}{route}: HTTP {status}: {message}")
        self.url, self.route, self.status, self.body = url, route, status, body


def settle(out: Future, task: asyncio.Task[list[GenResult]], batch: bool) -> None:
    """Give ``out`` the outcome of ``task``: its list of results (``batch``) or its one result
    (on a callback thread: ``out``'s callbacks run here)."""
    if task.cancelled():  # the client was closed with the request in flight
        out.set_exception(ServerLost("fleet", None, ConnectionAbortedError("FleetClient closed")))
    elif (e := task.exception()) is not None:
        out.set_exception(e)
    else:
        results = task.result()
        out.set_result(results if batch else results[0])


class Sink:
    """One batch's results on their way to its ``on_results`` (see
    :meth:`FleetClient.submit_batch`): handed over on the client's callback threads one call at
    a time and in order, then the future settled last."""

    def __init__(self, pool: ThreadPoolExecutor, on_results: Callable[[list[GenResult]], None]) -> None:
        self._pool, self._on_results = pool, on_results
        self._lock = threading.Lock()
        self._queue: deque[Callable[[], None]] = deque()
        self._draining = False
        self._given: set[int] = set()  # ids of the results handed over

    def put(self, results: list[GenResult]) -> None:
        self._run(functools.partial(self._hand, results))

    def finish(self, out: Future, task: asyncio.Task[list[GenResult]]) -> None:
        """Settle ``out`` with ``task``'s outcome after every result put so far; what the task
        returns that was not put (a whole reply, timed-out requests) is handed over first."""

        def last() -> None:
            if not task.cancelled() and task.exception() is None:
                self._hand([r for r in task.result() if id(r) not in self._given])
            self._given.clear()
            settle(out, task, True)

        self._run(last)

    def _hand(self, results: list[GenResult]) -> None:
        if not results:
            return
        self._given.update(id(r) for r in results)  # the task's result list keeps them alive
        try:
            self._on_results(results)
        except Exception:  # a callback's bug must not stop the batch's later results or its future
            log.exception("a FleetClient on_results callback failed")

    def _run(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(fn)
            if self._draining:
                return
            self._draining = True
        try:
            self._pool.submit(self._drain)
        except RuntimeError:  # closing: the callback threads are gone, run it here
            self._drain()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._draining = False
                    return
                fn = self._queue.popleft()
            fn()


def parse_json(raw: bytes) -> JsonValue:
    """A reply's JSON (its text if it is not JSON; ``{}`` if empty)."""
    try:
        return loads_json(raw) if raw else {}
    except ValueError:
        return raw.decode(errors="replace")


def post_json(
    url: str,
    route: str,
    body: object,
    *,
    method: str = "POST",
    timeout: float | None = None,
    request_id: str | None = None,
    api_key: str = "",
) -> JsonValue:
    """``body`` (None: no body) sent as JSON, with ``api_key`` ("" for none) as a bearer token;
    the answer parsed as JSON (its text if it is not)."""
    # Only routes the SGLang contract test has checked (protocol.ROUTES), with their method; our
    # own extensions of the built-in engine live under /megatron_rl/ (GET, but the streamed
    # weight update, a POST).
    extension = "POST" if route == STREAM_ROUTE else "GET" if route.startswith("/megatron_rl/") else None
    if ROUTES.get(route, extension) != method:
        raise ProtocolError(
            f"{method} {route} is not a route of SGLang {SGLANG_VERSION}'s API "
            "that the client speaks (generation/protocol.py ROUTES)"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"{url}: not a server URL (expected http://host[:port])")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        headers.update(auth_headers(api_key))
        conn.request(method, parts.path.rstrip("/") + route, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        raise ServerLost(url, request_id, e) from e
    finally:
        conn.close()
    payload = parse_json(raw)
    if resp.status != 200:
        raise ServerError(url, route, resp.status, payload)
    return payload
