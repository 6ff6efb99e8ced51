"""The fleet client's transport, below :class:`~megatron_rl.generation.client.FleetClient`: its
errors (a lost server, a refusal, a closed client), the blocking JSON call that control routes
use, and the hand-over of a request's results to the caller's callback (:class:`Sink`: in
order, on the I/O thread, then the future)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from megatron_rl.generation.engine.weights import STREAM_ROUTE
from megatron_rl.generation.protocol import (
    API_KEY_ENV,
    ROUTES,
    SGLANG_VERSION,
    ProtocolError,
    auth_headers,
    loads_reply,
)

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.api import GenResult

__all__ = [
    "ClientClosed",
    "Connections",
    "ServerError",
    "ServerLost",
    "Sink",
    "parse_json",
    "post_json",
    "settle",
    "unreachable",
]

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
    :meth:`FleetClient.submit_batch`): handed over on the client's I/O thread, where they are
    read, in order (one thread: calls never overlap), then the future settled last.

    On the I/O thread rather than a callback thread: a hand-over to another thread costs a
    wake-up and a context switch per completion, which at thousands of sequences in flight was
    a quarter of the orchestrator's CPU; so ``on_results`` must be quick and must never wait on
    the fleet (the I/O thread is what would answer it)."""

    def __init__(self, on_results: Callable[[list[GenResult]], None]) -> None:
        self._on_results = on_results
        self._given: set[int] = set()  # ids of the results handed over

    def put(self, results: list[GenResult]) -> None:
        if not results:
            return
        self._given.update(id(r) for r in results)  # the task's result list keeps them alive
        try:
            self._on_results(results)
        except Exception:  # a callback's bug must not stop the batch's later results or its future
            log.exception("a FleetClient on_results callback failed")

    def finish(self, out: Future, task: asyncio.Task[list[GenResult]]) -> None:
        """Settle ``out`` with ``task``'s outcome; what the task returns that was not put (a
        whole reply, timed-out requests) is handed over first."""
        if not task.cancelled() and task.exception() is None:
            self.put([r for r in task.result() if id(r) not in self._given])
        self._given.clear()
        settle(out, task, True)


def parse_json(raw: bytes) -> JsonValue:
    """A reply's JSON (its text if it is not JSON; ``{}`` if empty)."""
    try:
        return loads_reply(raw) if raw else {}
    except ValueError:
        return raw.decode(errors="replace")


class Connections:
    """Kept-alive connections for a client's control calls, per server: at most ``keep`` idle
    ones each, none reused after ``idle_s`` (SGLang's server drops an idle connection after 5 s,
    the built-in engine after 30). A weight update makes three calls to every server within
    milliseconds (pause, update, resume); each on a new connection is a TCP handshake and, on a
    threading server, a thread started, while the whole fleet waits paused."""

    def __init__(self, keep: int = 4, idle_s: float = 4.0) -> None:
        self.keep, self.idle_s = keep, idle_s
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[float, http.client.HTTPConnection]]] = {}

    def take(self, host: str, port: int, timeout: float | None) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``host:port`` (True) or a new one (False), with ``timeout``."""
        now = time.monotonic()
        with self._lock:
            stack = self._idle.get((host, port), [])
            while stack:
                since, conn = stack.pop()
                if now - since < self.idle_s and conn.sock is not None:
                    conn.timeout = timeout
                    conn.sock.settimeout(timeout)
                    return conn, True
                conn.close()
        return http.client.HTTPConnection(host, port, timeout=timeout), False

    def give(self, host: str, port: int, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            stack = self._idle.setdefault((host, port), [])
            if len(stack) < self.keep:
                stack.append((time.monotonic(), conn))
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for stack in idle.values():
            for _, conn in stack:
                conn.close()


# A kept-alive connection the server closed while it sat idle fails at once, before any answer:
# the request never reached the server, so it is sent again on a new connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def post_json(
    url: str,
    route: str,
    body: object,
    *,
    method: str = "POST",
    timeout: float | None = None,
    request_id: str | None = None,
    api_key: str = "",
    connections: Connections | None = None,
) -> JsonValue:
    """``body`` (None: no body) sent as JSON, with ``api_key`` ("" for none) as a bearer token;
    the answer parsed as JSON (its text if it is not). ``connections``: reuse kept-alive
    connections (else one per call)."""
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
    host, port = parts.hostname, parts.port or 80
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    headers.update(auth_headers(api_key))
    while True:
        if connections is not None:
            conn, reused = connections.take(host, port, timeout)
        else:
            conn, reused = http.client.HTTPConnection(host, port, timeout=timeout), False
        try:
            conn.request(method, parts.path.rstrip("/") + route, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except _STALE as e:
            conn.close()
            if reused:
                continue  # closed by the server while idle: again, on a new connection
            raise ServerLost(url, request_id, e) from e
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            conn.close()
            raise ServerLost(url, request_id, e) from e
        if connections is not None and not resp.will_close:
            connections.give(host, port, conn)
        else:
            conn.close()
        break
    payload = parse_json(raw)
    if resp.status != 200:
        raise ServerError(url, route, resp.status, payload)
    return payload


def unreachable(url: str, timeout_s: float) -> str | None:
    """Why nothing answers at ``url`` within ``timeout_s`` (no connection, or no HTTP answer to
    ``GET /health``), or None when a server answers. Any HTTP status counts as an answer: a
    server that is up but still loading, or that wants a key, is the fleet client's to wait for;
    an address where nothing listens is a mistake to name before the run starts."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(host, port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/health")
        conn.getresponse().read()
        return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except (OSError, http.client.HTTPException) as e:
        return (getattr(e, "strerror", None) or str(e) or type(e).__name__).lower()
    finally:
        conn.close()
