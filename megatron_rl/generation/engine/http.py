"""The built-in engine server's HTTP transport: the stdlib ``ThreadingHTTPServer`` and the request
handler that answers SGLang-shaped routes with JSON.

What the handler guarantees, whatever the route: the API key is checked before a body is read (a
refused body is drained, never parsed, and the connection closed); a body needs one
``Content-Length`` within the server's limit (no chunked uploads); every error is JSON
(``{"success": false, "message": ..., "error": {"message": ...}}``, never a traceback: those go to
the log); a ``/generate`` waiting for its tokens notices a client that hung up. Which method answers
a route is the server's table (``POST_ROUTES`` / ``GET_ROUTES`` of ``server.py``); this module
knows no route but ``/generate``.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import sys
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

    Body = dict[str, JsonValue]

__all__ = ["BadRequest", "ClientGone", "EngineHTTPServer", "Routed", "error_body", "make_handler"]

log = logging.getLogger("megatron_rl.engine_server")

# The most bytes of a refused request's body read (and dropped) before its connection closes:
# closing with unread bytes makes the kernel send a reset, which can reach the client before the
# 401 does; past this much we close anyway.
_DISCARD_LIMIT = 16 << 20
# The longest a refused connection is drained after its answer (_refuse_unread).
_LINGER_S = 2.0


class BadRequest(Exception):
    """A request the server refuses: answered with ``status`` and the message as JSON."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


class EngineHTTPServer(ThreadingHTTPServer):
    """A thread per connection, none of which holds up the process's exit."""

    # An RL fleet opens a connection per in-flight sample, a thousand and more at once: the
    # default backlog of 5 would refuse some, which a client must read as a dead server. The
    # kernel caps it at net.core.somaxconn (4096 on current kernels).
    request_queue_size = 4096
    daemon_threads = True

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


class Routed(Protocol):
    """What the handler needs of the server behind it."""

    max_body_bytes: int

    def authorized(self, path: str, authorization: str | None) -> bool: ...

    def generate(self, body: Body, client_gone: Callable[[], bool]) -> Body | list[Body]: ...


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

        def log_message(
            self, fmt: str, *args: object
        ) -> None:  # quiet: one line per request is noise at RL rates
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
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
            sock = self.connection
            try:
                sock.shutdown(socket.SHUT_WR)
                deadline, left = time.monotonic() + _LINGER_S, _DISCARD_LIMIT
                while left > 0 and (wait := deadline - time.monotonic()) > 0:
                    sock.settimeout(wait)
                    chunk = sock.recv(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:  # the client went first, or the drain timed out: nothing more to do
                pass

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
            return self.rfile.read(length) if length else b""

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
            self._send(HTTPStatus.OK, out)

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
