"""Control calls on kept-alive connections (``transport.Connections``): a call reuses the idle
connection the previous one left, and a connection the server closed while it sat idle is
replaced without the caller seeing it; an answer on a kept-alive connection is not held back by
Nagle's algorithm (the built-in engine sets TCP_NODELAY)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.generation.transport import Connections, ServerLost, post_json, unreachable


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    accepted = 0
    drop_after_answer = False  # close each connection after one answer, without saying so


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.server.accepted += 1  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"ok": True, "accepted": self.server.accepted}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.server.drop_after_answer:  # type: ignore[attr-defined]
            self.close_connection = True  # gone, though the answer promised keep-alive


@pytest.fixture()
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_calls_reuse_one_kept_alive_connection(server):
    conns = Connections()
    try:
        answers = [
            post_json(_url(server), "/health", None, method="GET", timeout=10, connections=conns)
            for _ in range(5)
        ]
    finally:
        conns.close()
    assert [a["accepted"] for a in answers] == [1] * 5  # one connection for all five
    assert server.accepted == 1


def test_a_connection_the_server_dropped_while_idle_is_replaced_unseen(server):
    server.drop_after_answer = True
    conns = Connections()
    try:
        answers = [
            post_json(_url(server), "/health", None, method="GET", timeout=10, connections=conns)
            for _ in range(3)
        ]
    finally:
        conns.close()
    assert [a["ok"] for a in answers] == [True] * 3
    assert server.accepted == 3  # each call after the first found its idle connection dead


def test_without_kept_alive_connections_each_call_opens_one(server):
    for _ in range(3):
        post_json(_url(server), "/health", None, method="GET", timeout=10)
    assert server.accepted == 3


def test_a_server_that_is_gone_is_lost_not_retried_forever():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once it is closed
    conns = Connections()
    with pytest.raises(ServerLost):
        post_json(f"http://127.0.0.1:{port}", "/health", None, method="GET", timeout=5, connections=conns)


def test_idle_connections_are_bounded_and_expire(server):
    port = server.server_address[1]
    conns = Connections(keep=2, idle_s=60.0)
    made = [conns.take("127.0.0.1", port, 5.0) for _ in range(4)]
    assert not any(reused for _, reused in made)  # none idle yet: new ones
    for c, _ in made:
        c.connect()
        conns.give("127.0.0.1", port, c)
    _, reused = conns.take("127.0.0.1", port, 5.0)
    assert reused  # an idle one
    conns.take("127.0.0.1", port, 5.0)
    assert not conns.take("127.0.0.1", port, 5.0)[1]  # only two were kept
    stale = Connections(keep=2, idle_s=0.0)
    c, _ = stale.take("127.0.0.1", port, 5.0)
    c.connect()
    stale.give("127.0.0.1", port, c)
    assert not stale.take("127.0.0.1", port, 5.0)[1]  # idle past idle_s: dropped, a new one made
    conns.close()
    stale.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: nothing listens there


def test_unreachable_names_why_nothing_answers(server):
    assert unreachable(_url(server), timeout_s=5) is None
    assert "refused" in (unreachable(f"http://127.0.0.1:{_closed_port()}", timeout_s=5) or "")
    with socket.socket() as silent:  # accepts (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        why = unreachable(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
    assert why == "no answer within 0.5 s"


def test_unreachable_counts_any_http_status_as_an_answer():
    class _NoHealth(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(401)  # up, but wants a key: the fleet client's to handle, not pre-flight's

        def log_message(self, *args: object) -> None:
            pass

    srv = _Server(("127.0.0.1", 0), _NoHealth)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert unreachable(_url(srv), timeout_s=5) is None
    finally:
        srv.shutdown()
        srv.server_close()
