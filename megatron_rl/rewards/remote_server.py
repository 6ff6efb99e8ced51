"""A verifier server: a :class:`VerifierPool` on another node, scoring over HTTP for
:class:`~megatron_rl.rewards.remote.VerifierFleet` (``megatron-rl verifier-server``).

``GET /health`` (no key needed) answers ``{"workers": n, "queued": k, "broken": why or null}``.
``POST /score`` (``Authorization: Bearer KEY`` when the server has a key; 401 otherwise) takes::

    {"reward": {...RewardConfig...}, "tasks": [{"id": "0", "input": {...RewardInput...}, "timeout_s": 19}, ...]}

and checks all of it before it queues anything: a bad body is a 400 naming the field
(``tasks[3].input.task: must be one of ['math', 'code'], got 'x'``), a body past
``max_body_mb`` or more than ``max_tasks`` tasks a 413. JSON only, never pickle: the records are
rebuilt and checked like a recipe (:func:`~megatron_rl.config.config_from_dict`). The answer is
``200`` with a chunked NDJSON stream, one line per task as it finishes -- ``{"id", "ok": true,
"result": {...RewardResult...}}`` or ``{"id", "ok": false, "reason": "worker_timeout" |
"worker_crash" | "verifier_error" | "scoring_timeout", "detail"}`` -- then ``{"done": n}``.

- **Heartbeats.** After ``_HEARTBEAT_S`` without a line, a blank one goes out: the client tells a
  live server from a dead one by them, and a write is how the server notices a client that hung
  up (also checked before each heartbeat): its tasks not yet started are then cancelled.
- **Bounded.** Every socket read and write has ``read_timeout_s``; a request's tasks have
  answers by the pool's deadline (past it, ``scoring_timeout``): no request holds a thread
  for ever.
- **Any run.** The reward config comes with every request (rebuilt configs are cached by their
  JSON text), so one server serves any run. ``code.python`` and ``code.pch_cache_dir`` name paths
  on the orchestrator's machine: the server uses its own. A ``custom`` reward runs only when the
  server allows its name (``--allow-custom``): resolving one imports a module.
- **Stopping.** ``close`` stops taking requests, then closes the pool (cancel by default); a
  stream still open ends without its ``done`` line, and its client runs the rest elsewhere.

Trust: whoever holds the key runs programs on this node (that is the service: code samples are
programs), inside the code sandbox. The server binds 127.0.0.1 unless told a host, and refuses
any other host without a key.

    with VerifierServer(workers=8, host="0.0.0.0", port=8400, api_key=key).start() as server:
        print(server.url)
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import queue
import select
import socket
import socketserver
import threading
import time
import types
import typing
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, TypeVar

from megatron_rl.config import ConfigError, config_from_dict
from megatron_rl.errors import UsageError
from megatron_rl.rewards.compose import RewardConfig, RewardInput, prepare_verifiers, score
from megatron_rl.rewards.custom import warm_up
from megatron_rl.rewards.pool import PoolBroken, PoolTaskError, VerifierPool, max_workers

__all__ = ["HEARTBEAT_S", "LOCAL_ONLY", "VerifierServer"]

log = logging.getLogger(__name__)
T = TypeVar("T")

HEARTBEAT_S = 2.0  # a blank line goes out after this long without one
LOCAL_ONLY = ("remote", "remote_api_key_env")  # RewardConfig fields a server neither needs nor gets
_MAX_TASK_TIMEOUT_S = 3600.0
_DISCARD = 16 << 20  # a refused body is read and dropped up to this much past the limit
_CONFIGS = 16  # rebuilt reward configs kept


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _rebuild(cls: type[T], data: object, path: str) -> T:
    """``cls`` from JSON, checked like a recipe; :class:`_BadRequest` naming the field."""
    if not isinstance(data, dict):
        raise _BadRequest(f"{path}: must be an object, got {type(data).__name__}")
    try:
        return config_from_dict(cls, data, source="body", prefix=f"{path}.")  # type: ignore[type-var]
    except ConfigError as e:
        raise _BadRequest(str(e).removeprefix("body: ")) from None
    except (ValueError, TypeError) as e:  # a dataclass's own check outside the typed ones
        raise _BadRequest(f"{path}: {e}") from None


@functools.cache
def _input_hints() -> dict[str, Any]:
    return typing.get_type_hints(RewardInput)


def _fits(value: object, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` as :func:`config_from_dict` reads it (or stricter)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, dict):
        return isinstance(value, origin)
    return False  # anything else: the full check decides


def _input(data: object, path: str) -> RewardInput:
    """A task's input. The full check (:func:`_rebuild`: a recipe's, ~0.5 ms as it reads the type
    hints again) runs only when this quick one finds something wrong, for its message."""
    hints = _input_hints()
    if isinstance(data, dict) and all(k in hints and _fits(v, hints[k]) for k, v in data.items()):
        try:
            return RewardInput(**data)
        except (TypeError, ValueError):  # a field missing, or the dataclass's own check
            pass
    return _rebuild(RewardInput, data, path)


def _warm_up_all(names: tuple[str, ...]) -> None:
    for name in names:
        warm_up(name)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    verifier: VerifierServer

    def server_bind(self) -> None:
        # HTTPServer's own asks DNS for the host's full name (socket.getfqdn): seconds, for nothing.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked replies
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.verifier.read_timeout_s)  # every read and write

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/health":
            return self._json(404, {"error": f"no route GET {self.path.split('?')[0]}"})
        self._json(200, self.server.verifier.health())

    def do_POST(self) -> None:
        srv = self.server.verifier
        try:
            if self.path.split("?")[0] != "/score":
                return self._json(404, {"error": f"no route POST {self.path.split('?')[0]}"}, drain=True)
            if srv.api_key and not hmac.compare_digest(
                self.headers.get("Authorization", "").encode(), f"Bearer {srv.api_key}".encode()
            ):
                return self._json(
                    401, {"error": "missing or wrong API key (Authorization: Bearer KEY)"}, drain=True
                )
            body = self._body()
        except _BadRequest as e:  # the body was not read: dropped (up to a bound), then closed
            return self._json(e.status, {"error": str(e)}, close=True, drain=e.status == 413)
        try:
            cfg, tasks = srv.parse(body)
        except _BadRequest as e:
            return self._json(e.status, {"error": str(e)})
        srv.stream(self, cfg, tasks)

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise _BadRequest("a body needs a Content-Length (no chunked uploads)", 411)
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise _BadRequest("a body needs a Content-Length", 411) from None
        limit = self.server.verifier.max_body_bytes
        if not 0 <= n <= limit:
            raise _BadRequest(f"body: {n} bytes, over the limit of {limit}", 413)
        raw = self.rfile.read(n)
        if len(raw) < n:  # the client hung up
            raise _BadRequest(f"body: ended after {len(raw)} of {n} bytes", 400)
        return raw

    def _json(self, status: int, obj: object, *, close: bool = False, drain: bool = False) -> None:
        if drain:  # read what was sent (up to a bound): closing on unread bytes resets the
            try:  # connection, and the reset can reach the client before this answer does
                n = int(self.headers.get("Content-Length", "0"))
                if 0 < n <= self.server.verifier.max_body_bytes + _DISCARD:
                    while n > 0:
                        got = len(self.rfile.read(min(n, 1 << 20)))
                        n = n - got if got else -1
                close = close or n != 0
            except (ValueError, OSError):
                close = True
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def client_gone(self) -> bool:
        """The client closed its end (it sends nothing else while it waits for this answer)."""
        sock = self.connection
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


class VerifierServer:
    """A verifier pool served over HTTP (see the module docstring). ``start`` serves on a thread;
    ``close`` stops taking requests, then closes the pool (``cancel``: nothing queued runs)."""

    def __init__(
        self,
        workers: int = 2,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str = "",
        allow_custom: Sequence[str] = (),
        max_body_mb: int = 64,
        max_tasks: int = 1024,
        read_timeout_s: float = 60.0,
    ):
        if api_key and not (api_key.isascii() and api_key.isprintable() and " " not in api_key):
            raise UsageError("api key: must be printable ASCII without spaces")
        if not api_key and not _is_loopback(host):
            raise UsageError(
                f"host {host}: serving beyond this machine needs an API key (--api-key-env VAR): "
                "whoever reaches the server runs programs on it"
            )
        if not 1 <= workers <= max_workers():
            raise UsageError(
                f"workers: must be in [1, {max_workers()}] on this machine ({os.cpu_count()} cores), got {workers}"
            )
        if not 1 <= max_tasks <= 1 << 20:
            raise UsageError(f"max_tasks: must be in [1, {1 << 20}], got {max_tasks}")
        if not 1 <= max_body_mb <= 4096:
            raise UsageError(f"max_body_mb: must be in [1, 4096], got {max_body_mb}")
        if not (math.isfinite(read_timeout_s) and read_timeout_s > 0):
            raise UsageError(f"read_timeout_s: must be a finite number > 0, got {read_timeout_s}")
        self.api_key = api_key
        self.allow_custom = tuple(allow_custom)
        self.max_body_bytes = max_body_mb << 20
        self.max_tasks = max_tasks
        self.read_timeout_s = read_timeout_s
        self.workers = workers
        # Bound before the pool starts: a port in use is said at once (EADDRINUSE: exit code 5).
        self.httpd = (_HTTPServer6 if ":" in host else _HTTPServer)((host, port), _Handler)
        self.httpd.verifier = self
        warmup = functools.partial(_warm_up_all, self.allow_custom) if self.allow_custom else None
        try:
            self.pool = VerifierPool(workers, warmup=warmup)
        except BaseException:
            self.httpd.server_close()
            raise
        self.host, self.port = host, self.httpd.server_address[1]
        self._lock = threading.Lock()
        self._configs: OrderedDict[str, RewardConfig] = OrderedDict()  # JSON text -> config
        self._queued = 0
        self._active: set[threading.Thread] = set()  # handlers streaming a /score answer
        self._thread: threading.Thread | None = None
        self.stats: Counter[str] = Counter()  # requests, tasks, cancelled, client_gone

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def start(self) -> VerifierServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="verifier-http", daemon=True)
        self._thread.start()
        return self

    def health(self) -> dict[str, object]:
        with self._lock:
            queued = self._queued
        return {"workers": self.workers, "queued": queued, "broken": self.pool.broken}

    def close(self, *, cancel: bool = True) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.pool.close(cancel=cancel)  # open streams see their tasks cancelled and end early
        with self._lock:
            active = list(self._active)
        for t in active:
            t.join(timeout=5)

    def __enter__(self) -> VerifierServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- a request ------------------------------------------------------------------------------
    def parse(self, raw: bytes) -> tuple[RewardConfig, list[tuple[str, RewardInput, float]]]:
        """The request's config and tasks, every field checked; :class:`_BadRequest` naming the
        first bad one. Nothing is queued before all of it is read."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise _BadRequest(f"body: not JSON ({e})") from None
        if not isinstance(body, dict):
            raise _BadRequest("body: must be an object with 'reward' and 'tasks'")
        unknown = sorted(set(body) - {"reward", "tasks"})
        if unknown:
            raise _BadRequest(f"{unknown[0]}: unknown field (known: reward, tasks)")
        cfg = self._config(body.get("reward"))
        tasks = body.get("tasks")
        if not isinstance(tasks, list) or not tasks:
            raise _BadRequest("tasks: must be a non-empty list")
        if len(tasks) > self.max_tasks:
            raise _BadRequest(f"tasks: {len(tasks)} tasks, over this server's limit of {self.max_tasks}", 413)
        out, ids = [], set()
        for i, t in enumerate(tasks):
            where = f"tasks[{i}]"
            if not isinstance(t, dict):
                raise _BadRequest(f"{where}: must be an object with id, input, timeout_s")
            extra = sorted(set(t) - {"id", "input", "timeout_s"})
            if extra:
                raise _BadRequest(f"{where}.{extra[0]}: unknown field (known: id, input, timeout_s)")
            task_id, limit = t.get("id"), t.get("timeout_s")
            if not isinstance(task_id, str) or not task_id or len(task_id) > 128:
                raise _BadRequest(f"{where}.id: must be a string of 1 to 128 characters, got {task_id!r}")
            if task_id in ids:
                raise _BadRequest(f"{where}.id: {task_id!r} is used twice")
            ids.add(task_id)
            if (
                isinstance(limit, bool)
                or not isinstance(limit, (int, float))
                or not 0 < limit <= _MAX_TASK_TIMEOUT_S
            ):
                raise _BadRequest(
                    f"{where}.timeout_s: must be a number in (0, {_MAX_TASK_TIMEOUT_S:g}], got {limit!r}"
                )
            inp = _input(t.get("input"), f"{where}.input")
            if inp.tests is not None and not all(isinstance(x, dict) for x in inp.tests):
                raise _BadRequest(f"{where}.input.tests: must be a list of objects")
            out.append((task_id, inp, float(limit)))
        return cfg, out

    def _config(self, data: object) -> RewardConfig:
        key = json.dumps(data, sort_keys=True)
        with self._lock:
            cfg = self._configs.get(key)
            if cfg is not None:
                self._configs.move_to_end(key)
                return cfg
        if isinstance(data, dict):
            custom = data.get("custom")
            if custom is not None and custom not in self.allow_custom:
                raise _BadRequest(
                    f"reward.custom: {custom!r} is not allowed on this server (allowed: "
                    f"{', '.join(self.allow_custom) or 'none'}; start it with --allow-custom NAME)"
                )
            data = {k: v for k, v in data.items() if k not in LOCAL_ONLY}
        cfg = _rebuild(RewardConfig, data, "reward")
        # Paths of the orchestrator's machine mean nothing here: the server's interpreter and cache.
        cfg = dataclasses.replace(cfg, code=dataclasses.replace(cfg.code, python="", pch_cache_dir=""))
        with self._lock:
            self._configs[key] = cfg
            while len(self._configs) > _CONFIGS:
                self._configs.popitem(last=False)
        return cfg

    def stream(self, h: _Handler, cfg: RewardConfig, tasks: list[tuple[str, RewardInput, float]]) -> None:
        """Answer ``tasks`` one NDJSON line each as they finish (see the module docstring)."""
        me = threading.current_thread()
        with self._lock:
            self._active.add(me)
            self.stats["requests"] += 1
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/x-ndjson")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            if not self._prepare(h, cfg, [inp for _, inp, _ in tasks]) or not self._answer(h, cfg, tasks):
                h.close_connection = True  # ended early: the missing done line tells the client
        except OSError:  # the client went away while we wrote
            h.close_connection = True
        finally:
            with self._lock:
                self._active.discard(me)

    def _prepare(self, h: _Handler, cfg: RewardConfig, inputs: list[RewardInput]) -> bool:
        """One-off set-up (a C++ precompiled header, seconds) with heartbeats going out meanwhile."""
        if not any(i.task == "code" for i in inputs):
            return True
        t = threading.Thread(
            target=prepare_verifiers, args=(inputs, cfg), name="verifier-prepare", daemon=True
        )
        t.start()
        while t.is_alive():
            t.join(HEARTBEAT_S)
            if t.is_alive():
                if h.client_gone():
                    return False
                h.chunk(b"\n")
        return True

    def _answer(self, h: _Handler, cfg: RewardConfig, tasks: list[tuple[str, RewardInput, float]]) -> bool:
        done: queue.SimpleQueue[int] = queue.SimpleQueue()
        try:
            futures = self.pool.submit_many(
                score, [(inp, cfg) for _, inp, _ in tasks], timeout_s=[t for *_, t in tasks]
            )
        except (PoolBroken, RuntimeError) as e:  # closing or broken: the client re-runs them elsewhere
            log.warning("refused %d tasks: %s", len(tasks), e)
            return False
        deadline = self.pool.deadline()
        with self._lock:
            self._queued += len(futures)
            self.stats["tasks"] += len(futures)
        for i, f in enumerate(futures):
            f.add_done_callback(functools.partial(self._finished, done, i))
        answered = [False] * len(tasks)
        left, last_write = len(tasks), time.monotonic()
        try:
            while left:
                now = time.monotonic()
                try:
                    ready = [done.get(timeout=max(0.0, min(HEARTBEAT_S, deadline - now)))]
                    while not done.empty():
                        ready.append(done.get_nowait())
                except queue.Empty:
                    ready = []
                lines = []
                for i in ready:
                    if answered[i]:
                        continue
                    line = self._line(tasks[i][0], futures[i])
                    if line is None:  # the pool was closed under us: end without the done line
                        return False
                    answered[i], left = True, left - 1
                    lines.append(line)
                if not ready and time.monotonic() >= deadline:  # past the pool's own bound
                    for i, f in enumerate(futures):
                        if not answered[i]:
                            f.cancel()
                            why = {
                                "reason": "scoring_timeout",
                                "detail": "no result by the server's deadline",
                            }
                            lines.append(json.dumps({"id": tasks[i][0], "ok": False, **why}).encode())
                            answered[i], left = True, left - 1
                if lines:
                    h.chunk(b"\n".join(lines) + b"\n")
                    last_write = time.monotonic()
                elif time.monotonic() - last_write >= HEARTBEAT_S:
                    if h.client_gone():
                        raise ConnectionResetError("the client closed its connection")
                    h.chunk(b"\n")
                    last_write = time.monotonic()
            h.chunk(json.dumps({"done": len(tasks)}).encode() + b"\n")
            h.chunk(b"")  # the last chunk
            return True
        except OSError:
            cancelled = sum(f.cancel() for f in futures)  # those not started yet
            with self._lock:
                self.stats["client_gone"] += 1
                self.stats["cancelled"] += cancelled
            raise

    def _finished(self, done: queue.SimpleQueue[int], i: int, _f: Future) -> None:
        with self._lock:
            self._queued -= 1
        done.put(i)

    @staticmethod
    def _line(task_id: str, f: Future) -> bytes | None:
        try:
            result = f.result()
        except CancelledError:
            return None
        except PoolTaskError as e:
            if e.reason == "cancelled":
                return None
            return json.dumps({"id": task_id, "ok": False, "reason": e.reason, "detail": e.detail}).encode()
        except Exception as e:  # noqa: BLE001 -- a task's failure, whatever it is, is its answer
            why = f"{type(e).__name__}: {e}"
            return json.dumps(
                {"id": task_id, "ok": False, "reason": "verifier_error", "detail": why}
            ).encode()
        return json.dumps({"id": task_id, "ok": True, "result": result.to_json()}, default=str).encode()
