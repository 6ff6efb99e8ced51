"""The built-in engine server's HTTP transport: the stdlib ``ThreadingHTTPServer`` and the request
handler that answers SGLang-shaped routes with JSON.

What the handler guarantees, whatever the route: the API key is checked before a body is read (a
refused body is drained, never parsed, and the connection closed); a body needs one
``Content-Length`` within the server's limit (no chunked uploads); every error is JSON
(``{"success": false, "message": ..., "error": {"message": ...}}``, never a traceback: those go to
the log); a ``/generate`` waiting for its tokens notices a client that hung up. Which method answers
a route is the server's table (``POST_ROUTES`` / ``GET_ROUTES`` of ``server.py``); this module
knows no route but ``/generate``.

**Hostile clients.** A connection holds a thread, so a client must not be able to hold one for
nothing. Every request has one read deadline, ``read_timeout_s`` from the moment the server
starts waiting for it, covering the request line, the headers and the body together (a client
that dribbles a byte a second does not reset it): past it a body still arriving is answered 408
and a request line or headers still arriving is closed without an answer; an idle keep-alive
connection is closed the same way. Writing an answer is bounded by the same time. And one client
address holds at most ``max_conns_per_client`` connections at once: the next is answered 503
naming the limit and closed, on a short-lived thread of its own (or, past
``_MAX_REFUSING`` such refusals at once, closed unanswered).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

    Body = dict[str, JsonValue]

__all__ = [
    "DEFAULT_MAX_CONNS_PER_CLIENT",
    "DEFAULT_READ_TIMEOUT_S",
    "BadRequest",
    "ClientGone",
    "EngineHTTPServer",
    "Routed",
    "StreamedReply",
    "error_body",
    "make_handler",
]

log = logging.getLogger("megatron_rl.engine_server")

# The most bytes of a refused request's body read (and dropped) before its connection closes:
# closing with unread bytes makes the kernel send a reset, which can reach the client before the
# 401 does; past this much we close anyway.
_DISCARD_LIMIT = 16 << 20
# The longest a refused connection is drained after its answer (_refuse_unread).
_LINGER_S = 2.0
# A request's read deadline: long enough for a 64 MB body over a slow link and for a client
# pausing between its header and its body; short enough that stalled connections are gone
# before they pile up. aiohttp (the fleet client) closes an idle keep-alive connection after 15 s,
# before the server would.
DEFAULT_READ_TIMEOUT_S = 30.0
# Connections one client address may hold at once. A trainer opens one per in-flight sample
# (FleetClient's max_connections is 0, unbounded, by default), so the default admits a large
# fleet's worth from one host: the listen backlog's size. 0: no limit.
DEFAULT_MAX_CONNS_PER_CLIENT = 4096
# Over-limit connections being answered 503 at once; past this many they are closed unanswered,
# so a flood of connections cannot turn into a flood of threads.
_MAX_REFUSING = 64
# How long an over-limit connection is drained after its 503 (see _refuse_unread's why).
_REFUSE_LINGER_S = 0.5


class BadRequest(Exception):
    """A request the server refuses: answered with ``status`` and the message as JSON."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


class _NotServing(BaseHTTPRequestHandler):
    """The handler of a server bound before its routes exist (it never serves with this one)."""

    def handle(self) -> None:
        self.close_connection = True


class EngineHTTPServer(ThreadingHTTPServer):
    """A thread per connection, none of which holds up the process's exit; at most
    ``max_conns_per_client`` connections per client address (0: no limit), and every request
    read within ``read_timeout_s`` (see the module docstring).

    ``handler`` may be set later (``RequestHandlerClass``): ``megatron-rl serve-engine`` binds
    its port before it loads the model, so that a port in use is reported before the wait."""

    # An RL fleet opens a connection per in-flight sample, a thousand and more at once: the
    # default backlog of 5 would refuse some, which a client must read as a dead server. The
    # kernel caps it at net.core.somaxconn (4096 on current kernels).
    request_queue_size = 4096
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler] = _NotServing,
        *,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_conns_per_client: int = DEFAULT_MAX_CONNS_PER_CLIENT,
    ) -> None:
        if not (math.isfinite(read_timeout_s) and read_timeout_s > 0):
            raise ValueError(f"read_timeout_s: must be a finite number > 0, got {read_timeout_s}")
        if max_conns_per_client < 0:
            raise ValueError(f"max_conns_per_client: must be >= 0 (0: no limit), got {max_conns_per_client}")
        self.read_timeout_s = read_timeout_s
        self.max_conns_per_client = max_conns_per_client
        self._open: dict[str, int] = {}  # client address -> connections being served
        self._refusing = 0  # over-limit connections being answered now
        self._count_lock = threading.Lock()
        self.refused_connections = 0  # over the per-client limit, since start
        self.accepted_connections = 0  # served, since start (a client reusing its own: few)
        super().__init__(address, handler)

    def open_connections(self) -> dict[str, int]:
        """Connections being served now, per client address."""
        with self._count_lock:
            return dict(self._open)

    def process_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        """Serve the connection on a thread of its own, unless its address holds its limit."""
        host = str(client_address[0])
        with self._count_lock:
            held = self._open.get(host, 0)
            over = 0 < self.max_conns_per_client <= held
            if over:
                self.refused_connections += 1
                answer = self._refusing < _MAX_REFUSING
                self._refusing += answer
            else:
                self._open[host] = held + 1
                self.accepted_connections += 1
        if not over:
            try:
                return super().process_request(request, client_address)
            except BaseException:  # no thread to serve it (and so none to count it down)
                self._release(host)
                raise
        log.warning(
            "refused a connection from %s: it holds %d (--max-conns-per-client %d)",
            host,
            held,
            self.max_conns_per_client,
        )
        if not answer:
            return self.shutdown_request(request)
        message = (
            f"too many connections from {host}: it holds {held}, this server's "
            f"--max-conns-per-client; retry when one closes"
        )
        threading.Thread(
            target=self._refuse, args=(request, message), name="engine-refuse", daemon=True
        ).start()

    def _refuse(self, sock: socket.socket, message: str) -> None:
        """Answer 503 without reading the request, then a short lingering close."""
        data = json.dumps(error_body(message)).encode()
        head = (
            f"HTTP/1.1 {HTTPStatus.SERVICE_UNAVAILABLE.value} Service Unavailable\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n"
        )
        try:
            sock.settimeout(_REFUSE_LINGER_S)
            sock.sendall(head.encode() + data)
            _linger(sock, _REFUSE_LINGER_S)
        except OSError:
            pass
        finally:
            self.shutdown_request(sock)
            with self._count_lock:
                self._refusing -= 1

    def process_request_thread(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]))

    def _release(self, host: str) -> None:
        """One connection of ``host`` is done."""
        with self._count_lock:
            left = self._open.get(host, 1) - 1
            if left > 0:
                self._open[host] = left
            else:
                self._open.pop(host, None)

    def handle_error(self, request: object, client_address: object) -> None:
        """A connection's unhandled exception: to the log (never to the client), quietly for a
        client that hung up."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("connection from %s: %r", client_address, exc)
        else:
            log.exception("connection from %s failed", client_address)


class ClientGone(Exception):
    """The client closed its connection while its request waited: nothing to answer."""


class _ReadDeadline(TimeoutError):
    """A request's read deadline passed (the stdlib's handler closes on a ``TimeoutError``)."""


class _DeadlineReader(io.RawIOBase):
    """A socket's receive side under one deadline for a whole request: every ``recv`` waits at
    most what is left of it, however the buffered reader above splits a line or a body into
    reads, so a client sending a byte at a time cannot stretch a request past it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline = math.inf  # time.monotonic() past which reads fail

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _ReadDeadline("the request's read deadline passed")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise _ReadDeadline("the request's read deadline passed") from None


def _linger(sock: socket.socket, seconds: float, limit: int = _DISCARD_LIMIT) -> None:
    """After an answer: stop writing, and read (and drop) what the client still sends for up to
    ``seconds`` or ``limit`` bytes, so that its kernel has the answer before a reset for unread
    bytes could overtake it. OSError: the client went first, or the time ran out."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline, left = time.monotonic() + seconds, limit
        while left > 0 and (wait := deadline - time.monotonic()) > 0:
            sock.settimeout(wait)
            chunk = sock.recv(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)
    except OSError:
        pass


class Routed(Protocol):
    """What the handler needs of the server behind it."""

    max_body_bytes: int

    def authorized(self, path: str, authorization: str | None) -> bool: ...

    def generate(self, body: Body, client_gone: Callable[[], bool]) -> Body | list[Body] | StreamedReply: ...


class StreamedReply(Protocol):
    """A reply sent as server-sent events (``/generate`` with ``stream``): each item is a list of
    JSON objects sent together, one ``data:`` event each; ``close`` is called however it ends.
    ``ended``: nothing more will come (the item just taken was the last)."""

    def __iter__(self) -> Iterator[list[Body]]: ...

    @property
    def ended(self) -> bool: ...

    def close(self) -> None: ...


def _frame(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked reply."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def error_body(message: str) -> Body:
    """Every error's JSON (SGLang's ``message`` and ``error.message``; never a traceback)."""
    return {"success": False, "message": message, "error": {"message": message}}


def make_handler(
    server: Routed, post_routes: Mapping[str, str], get_routes: Mapping[str, str]
) -> type[BaseHTTPRequestHandler]:
    """The handler class for ``server``: each route of the two tables (path -> the name of the
    server's method) answered by that method, every other path 404."""
    post: dict[str, Callable[[Body], Body | list[Body]]] = {
        path: getattr(server, name) for path, name in post_routes.items()
    }
    get: dict[str, Callable[[], Body]] = {path: getattr(server, name) for path, name in get_routes.items()}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        _peer_sent_more = False  # the client sent bytes past its request: stop watching for EOF
        server: EngineHTTPServer  # the server that made this handler
        _reader: _DeadlineReader

        def setup(self) -> None:
            super().setup()
            self._reader = _DeadlineReader(self.connection)
            self.rfile = io.BufferedReader(self._reader)  # every read under the request's deadline

        def handle_one_request(self) -> None:
            # The deadline runs from the moment the server waits for the request: an idle
            # keep-alive connection is closed by it too.
            self._reader.deadline = time.monotonic() + self.server.read_timeout_s
            super().handle_one_request()

        def log_message(
            self, fmt: str, *args: object
        ) -> None:  # quiet: one line per request is noise at RL rates
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
            # A client that does not read its answer holds the thread no longer than one that
            # does not send its request (sendall's timeout bounds the whole write).
            self.connection.settimeout(self.server.read_timeout_s)
            self._nodelay(True)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's own refusals (a bad request line, a header too long, a method with
            no handler) as JSON, not its HTML page; the connection then closes. A request line
            too broken to name its version still gets a status line (the stdlib would take it
            for HTTP/0.9 and send the body bare)."""
            self.close_connection = True
            if self.request_version == "HTTP/0.9":
                self.request_version = self.protocol_version
            self._send(code, error_body(message or HTTPStatus(code).phrase), {"Connection": "close"})

        def _refused(self) -> bool:
            """Answer 401 and end the connection unless the request may be served (the API key).

            The body of a refused request is read in chunks and dropped (up to _DISCARD_LIMIT),
            never parsed; the connection then closes, so it cannot be read as a next request."""
            if server.authorized(self.path.split("?")[0], self.headers.get("Authorization")):
                return False
            try:
                left = min(int(self.headers.get("Content-Length") or 0), _DISCARD_LIMIT)
            except ValueError:
                left = 0
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
            self.close_connection = True
            self._send(
                HTTPStatus.UNAUTHORIZED,
                {"error": "Unauthorized"},
                {"WWW-Authenticate": "Bearer", "Connection": "close"},
            )
            return True

        def _refuse_unread(self, status: int, message: str) -> None:
            """Answer an error without reading the body, then close: the write side first, then
            a bounded drain of what the client still sends (a lingering close), so that its
            kernel has our answer before a reset for unread bytes could overtake it."""
            self.close_connection = True
            self._send(status, error_body(message), {"Connection": "close"})
            _linger(self.connection, _LINGER_S)

        def _body(self) -> bytes | None:
            """The request body, at most ``server.max_body_bytes``; None once refused."""
            if self.headers.get("Transfer-Encoding"):
                self._refuse_unread(
                    HTTPStatus.LENGTH_REQUIRED, "Transfer-Encoding: not supported; send Content-Length"
                )
                return None
            values = self.headers.get_all("Content-Length") or []
            if len(set(values)) > 1 or not all(v.strip().isdigit() for v in values):  # isdigit: no sign
                self._refuse_unread(
                    HTTPStatus.BAD_REQUEST, f"Content-Length: must be one integer >= 0, got {values}"
                )
                return None
            length = int(values[0]) if values else 0
            if length > server.max_body_bytes:
                self._refuse_unread(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"Content-Length: {length} bytes, more than this server's --max-body-mb "
                    f"({server.max_body_bytes} bytes)",
                )
                return None
            try:
                return self.rfile.read(length) if length else b""
            except _ReadDeadline:
                self.close_connection = True
                self._send(
                    HTTPStatus.REQUEST_TIMEOUT,
                    error_body(
                        f"the request body did not arrive within this server's --read-timeout-s "
                        f"({self.server.read_timeout_s:g} s, head and body together)"
                    ),
                    {"Connection": "close"},
                )
                return None

        def _client_gone(self) -> bool:
            """Whether the client closed its connection (EOF or reset), without blocking or
            consuming a byte. ``poll``, not ``select``: a server with a thousand connections has
            descriptors past select's 1024. A client that half-closes its side after sending
            reads as gone, as it does to SGLang's uvicorn."""
            if self._peer_sent_more:
                return False
            p = select.poll()
            p.register(self.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
            if not p.poll(0):
                return False
            try:
                data = self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:  # a reset
                return True
            self._peer_sent_more = bool(data)
            return not data

        def _dispatch(self, fn: Callable[..., object], *args: object) -> None:
            try:
                out = fn(*args)
            except BadRequest as e:
                return self._send(e.status, error_body(str(e)))
            except ClientGone:
                self.close_connection = True
                return None
            except Exception as e:
                log.exception("%s failed", self.path)  # the traceback goes to the log only
                return self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR, error_body(f"internal error: {type(e).__name__}")
                )
            if isinstance(out, (dict, list)):
                return self._send(HTTPStatus.OK, out)
            self._send_stream(out)  # type: ignore[arg-type]  # only /generate streams

        def _send_stream(self, out: StreamedReply) -> None:
            """``out`` as server-sent events in a chunked reply (SGLang's stream form: ``data:
            {...}`` events, then ``data: [DONE]``); each item of ``out`` is one chunk, so what
            finished together arrives together, and the last goes out in one write with
            ``[DONE]`` and the chunked end: the client frees the connection (for its next
            request) as it reads the last result, not a delayed ACK later (Nagle is on for a
            stream). A client gone ends it (``out.close`` aborts the rest); an error after the
            status line can only close the connection."""
            self.connection.settimeout(self.server.read_timeout_s)  # bounds each write, as _send
            self._nodelay(False)
            end = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for items in out:
                    data = _frame(b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in items))
                    self.wfile.write(data + end if out.ended else data)
                    if out.ended:
                        break
                else:
                    self.wfile.write(end)
            except ClientGone:
                self.close_connection = True
            except OSError:  # the client went away mid-stream (reset, broken pipe, write timeout)
                self.close_connection = True
            except Exception:
                log.exception("%s failed while streaming", self.path)
                self.close_connection = True
            finally:
                out.close()

        def _nodelay(self, on: bool) -> None:
            """Nagle's algorithm off for an answer, on for a stream. An answer goes out as a
            header write and a body write, and on a kept-alive connection Nagle holds the body
            until the client ACKs the headers, which a delayed ACK puts off ~40 ms (each
            control call of a weight update, the fleet paused). A stream's events are better
            coalesced: what finishes while the last event is unacknowledged goes in one segment,
            fewer reads for a client with thousands in flight (measured: ~25% of its CPU)."""
            with contextlib.suppress(OSError):  # not TCP (a test's socketpair)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(on))

        def do_GET(self) -> None:
            if self._refused():
                return None
            fn = get.get(self.path.split("?")[0])
            if fn is None:
                return self._send(HTTPStatus.NOT_FOUND, error_body(f"no route {self.path}"))
            self._dispatch(fn)

        def do_POST(self) -> None:
            if self._refused():
                return None
            raw = self._body()
            if raw is None:
                return None
            route = self.path.split("?")[0]
            fn = post.get(route)
            if fn is None:
                return self._send(HTTPStatus.NOT_FOUND, error_body(f"no route {self.path}"))
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except (ValueError, RecursionError) as e:  # RecursionError: nesting past Python's limit
                return self._send(HTTPStatus.BAD_REQUEST, error_body(f"bad JSON body: {e}"))
            if route == "/generate":
                return self._dispatch(server.generate, body, self._client_gone)
            self._dispatch(fn, body)

    return Handler
