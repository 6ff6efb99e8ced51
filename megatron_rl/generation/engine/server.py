"""The built-in engine server: SGLang's HTTP API (the subset in ``generation/protocol.py``) over
the PyTorch :class:`~megatron_rl.generation.engine.Engine`.

    MEGATRON_RL_API_KEY=KEY megatron-rl serve-engine --model HF_FOLDER --port 30000 [--max-slots 16]

One thread runs the engine loop (admit, prefill, decode a step, hand finished requests back);
HTTP requests are served by a thread each (``ThreadingHTTPServer``) and wait on their own
request's completion. The engine lock is held for one whole step, so control requests (pause,
weight loads, abort) land *between* steps.

- ``/generate``: token ids in (``input_ids``, one list or a batch of lists), ``output_ids`` with
  ``meta_info.output_token_logprobs`` and ``weight_versions`` spans out. Text prompts are refused
  (the server has no tokenizer); ``stream`` is refused.
- ``/pause_generation`` ``in_place``: the loop stops after the step in progress; running requests
  keep their slots and KV cache. ``abort``: every request ends (``finish_reason`` abort) and the
  loop stops. ``retract`` is refused (it recomputes prefixes, which we never want).
  ``/continue_generation`` restarts the loop.
- ``/init_weights_update_group``: joins the update group (``generation/update_group.py``) as rank
  ``rank_offset`` (one worker per server). ``/begin_weight_update`` ... ``/end_weight_update``
  bracket the updates, as SGLang 0.5.23 requires. ``/update_weights_from_distributed``: receives
  one bucket (``flattened_bucket``) or one broadcast per tensor, then copies the tensors into the
  model's HF-named parameters under the engine lock and, with ``weight_version``, sets the version
  that later tokens record. The receive does not hold the lock: decoding goes on while bytes
  arrive unless the caller paused first. ``flush_cache`` has nothing to flush (no prefix cache;
  running requests keep their KV cache either way).
- ``/get_server_info``: ``max_total_num_tokens`` (KV capacity), ``max_running_requests``,
  ``context_length``, ``weight_version``, live counts in ``internal_states``.
- Extensions (not SGLang): ``GET /megatron_rl/weights_digest`` -> sha256 of every parameter's
  bytes, so a test or an operator can prove a server holds exactly the trainer's weights.
  ``POST /megatron_rl/receive_raw`` ``{"group_name": ..., "numel": N}`` receives one ``uint8``
  broadcast of N bytes from rank 0 of that update group and discards it (no session, no lock):
  the bare transport cost that ``tools/bench_weight_sync.py`` compares a weight update against.

**API key**, as SGLang's ``--api-key`` (``sglang/srt/utils/auth.py``, 0.5.23): with a key
(``--api-key KEY``, or ``$MEGATRON_RL_API_KEY``, which unlike argv does not show in ``ps``) every
route but ``OPEN_ROUTES`` (the health checks, for probes), and any unknown path, wants
``Authorization: Bearer KEY``; otherwise the answer is 401 ``{"error": "Unauthorized"}`` and
nothing else happens: the body is read only to be discarded, never parsed. Without a key the
server is open, as SGLang's is, and says so in its log when it listens beyond loopback.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

import torch

from megatron_rl.fileio import atomic_write_text
from megatron_rl.generation.engine.engine import Engine, EngineConfig, Finished
from megatron_rl.generation.engine.timing import TimingEngine
from megatron_rl.generation.protocol import (
    API_KEY_ENV,
    api_key_from_env,
    bucket_layout,
    check_api_key,
    tensor_digest,
    unpack_bucket,
)
from megatron_rl.generation.update_group import broadcast, destroy_update_group, init_update_group

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatron_rl.fileio import JsonValue

#: A route's JSON body (an object, checked in do_POST) and what it answers.
Body = dict[str, "JsonValue"]

__all__ = ["GET_ROUTES", "OPEN_ROUTES", "POST_ROUTES", "EngineServer", "main"]

log = logging.getLogger("megatron_rl.engine_server")

SERVER_VERSION = "megatron-rl-engine (SGLang 0.5.23 API subset)"

# Every route, by HTTP method: path -> the EngineServer method that answers it. The handler
# dispatches from these tables alone, so tests/generation/test_auth.py, which reads them, sees
# every route there is.
POST_ROUTES: dict[str, str] = {
    "/generate": "generate",
    "/pause_generation": "pause",
    "/continue_generation": "resume",
    "/abort_request": "abort",
    "/init_weights_update_group": "init_group",
    "/destroy_weights_update_group": "destroy_group",
    "/begin_weight_update": "begin_update",
    "/end_weight_update": "end_update",
    "/update_weights_from_distributed": "update_weights",
    "/update_weight_version": "update_version",
    "/flush_cache": "flush_cache",
    "/megatron_rl/receive_raw": "receive_raw",
}
GET_ROUTES: dict[str, str] = {
    "/get_server_info": "server_info",
    "/server_info": "server_info",
    "/health": "health",
    "/health_generate": "health",
    "/megatron_rl/weights_digest": "weights_digest",
}
# Answered without the API key. SGLang exempts the /health*, /ready* and /metrics* prefixes (for
# probes and scrapers); we name our two health routes exactly, so no new route is open by its name.
OPEN_ROUTES = frozenset({"/health", "/health_generate"})

# The most bytes of a refused request's body read (and dropped) before its connection closes:
# closing with unread bytes makes the kernel send a reset, which can reach the client before the
# 401 does; past this much we close anyway.
_DISCARD_LIMIT = 16 << 20


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


class _Waiter:
    __slots__ = ("event", "result")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Finished | None = None

    def finished(self) -> Finished:
        """The result, once ``event`` is set (``_deliver`` sets the result first)."""
        if self.result is None:
            raise RuntimeError("a request was marked done without a result")
        return self.result


class EngineServer:
    """An :class:`Engine` behind SGLang-shaped HTTP routes. ``serve_forever`` blocks;
    ``start()`` serves from a daemon thread (tests), ``shutdown()`` stops both threads."""

    def __init__(
        self,
        engine: Engine | TimingEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "",
        api_key: str = "",
    ) -> None:
        """``api_key`` "": no key (every route open)."""
        self.engine = engine
        self._api_key = check_api_key(api_key).encode()
        self.model_path = model_path
        self.cond = threading.Condition()
        # Handlers waiting for the lock (see _between_steps); the engine loop yields to them.
        self._intents = 0
        self._intents_lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._session = False
        self._stop = False
        self._rid_counter = 0
        self.stats = {"steps": 0, "busy_s": 0.0, "generated_tokens": 0, "weight_updates": 0}
        # A deep listen backlog: an RL fleet opens hundreds of connections at once, and the
        # default of 5 would refuse some (which a client must read as a dead server).
        ThreadingHTTPServer.request_queue_size = 1024
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True
        bound_host, self.port = self.httpd.server_address[:2]
        # An AF_INET server's host is a str; typeshed allows bytes for other address families.
        self.host = bound_host.decode() if isinstance(bound_host, (bytes, bytearray)) else bound_host
        if not self._api_key and not _is_loopback(self.host):
            log.warning(
                "serving on %s without an API key: whoever reaches it can pause it and replace its "
                "weights (set --api-key or $%s)",
                self.url,
                API_KEY_ENV,
            )
        self._loop = threading.Thread(target=self._engine_loop, name="engine-loop", daemon=True)
        self._http_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def authorized(self, path: str, authorization: str | None) -> bool:
        """Whether a request for ``path`` with this ``Authorization`` header may be served."""
        if not self._api_key or path in OPEN_ROUTES:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        # Constant time in the key's bytes; only a length difference shows.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.encode("utf-8", "replace"), self._api_key
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EngineServer:
        self._loop.start()
        self._http_thread = threading.Thread(target=self.httpd.serve_forever, name="engine-http", daemon=True)
        self._http_thread.start()
        return self

    def serve_forever(self) -> None:
        self._loop.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._http_thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ engine loop

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The engine lock for a request handler, taken before the engine's next step.

        The engine loop takes the lock again as soon as a step ends, and Python's locks are not
        fair: without this a busy engine could keep a pause or a weight update waiting for
        hundreds of steps (seen under load: a 400-token generation finished before the pause
        that was sent after its 30th step got the lock). A handler announces itself first; the
        loop does not start a step while one is announced.
        """
        with self._intents_lock:
            self._intents += 1
        try:
            self.cond.acquire()
        finally:
            with self._intents_lock:
                self._intents -= 1
        try:
            yield
        finally:
            self.cond.notify_all()  # the loop may be waiting for this handler only
            self.cond.release()

    def _engine_loop(self) -> None:
        while True:
            with self.cond:
                while not self._stop and (self._intents or self.engine.paused or not self.engine.has_work()):
                    self.cond.wait()
                if self._stop:
                    return
                t0 = time.perf_counter()
                try:
                    finished = self.engine.step()
                except Exception as e:  # a model error must not leave clients waiting forever
                    log.exception("engine step failed")
                    aborted = [self.engine.abort(rid) for rid in list(self._waiters)]
                    finished = [f for f in aborted if f is not None]
                    for f in finished:
                        f.error = f"engine step failed: {e}"  # type: ignore[attr-defined]  # a note _reply reads with getattr
                self.stats["steps"] += 1
                self.stats["busy_s"] += time.perf_counter() - t0
                self._deliver(finished)

    def _deliver(self, finished: list[Finished]) -> None:
        for f in finished:
            self.stats["generated_tokens"] += len(f.token_ids)
            w = self._waiters.pop(f.request_id, None)
            if w is not None:
                w.result = f
                w.event.set()

    # ------------------------------------------------------------------ routes

    def generate(self, body: Body) -> Body | list[Body]:
        if body.get("text") is not None or body.get("input_ids") is None:
            raise _BadRequest(
                "input_ids: required (the built-in engine has no tokenizer; send token ids, not text)"
            )
        if body.get("stream"):
            raise _BadRequest("stream: not supported by the built-in engine")
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        rids = body.get("rid")
        if rids is None:
            rids = [self._next_rid() for _ in prompts]
        elif not batch:
            rids = [rids]
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(rids) != len(prompts) or len(params_list) != len(prompts):
            raise _BadRequest("rid / sampling_params: need one per prompt")
        waiters = []
        with self._between_steps():
            for rid, prompt, sp in zip(rids, prompts, params_list):
                rid = str(rid)
                if rid in self._waiters:
                    raise _BadRequest(f"rid: {rid!r} is already in flight")
                unknown = set(sp) - _SAMPLING_KEYS
                if unknown:
                    raise _BadRequest(
                        f"sampling_params: not supported by the built-in engine: {sorted(unknown)}"
                    )
                if sp.get("stop"):
                    raise _BadRequest(
                        "sampling_params.stop: stop strings need a tokenizer; use stop_token_ids"
                    )
                try:
                    self.engine.add_request(
                        rid,
                        prompt,
                        max_new_tokens=int(sp.get("max_new_tokens", 128)),
                        temperature=float(sp.get("temperature", 1.0)),
                        top_p=float(sp.get("top_p", 1.0)),
                        seed=sp.get("sampling_seed"),
                        stop_token_ids=sp.get("stop_token_ids") or (),
                    )
                except (ValueError, TypeError) as e:
                    raise _BadRequest(str(e)) from None
                w = _Waiter()
                self._waiters[rid] = w
                waiters.append(w)
            self.cond.notify_all()
        for w in waiters:
            w.event.wait()
        out = [self._reply(w.finished()) for w in waiters]
        return out if batch else out[0]

    def _next_rid(self) -> str:
        with self._between_steps():
            self._rid_counter += 1
            return f"engine-{os.getpid()}-{self._rid_counter}"

    def _reply(self, f: Finished) -> Body:
        n = len(f.token_ids)
        spans: list[dict[str, str | int]] = []
        for i, v in enumerate(f.versions):
            if spans and spans[-1]["version"] == str(v):
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": str(v), "start": i, "end": i + 1})
        if not spans:
            spans = [{"version": str(self.engine.version), "start": 0, "end": 0}]
        if f.finish_reason == "stop":
            finish = {"type": "stop", "matched": f.token_ids[-1] if n else None}
        elif f.finish_reason == "length":
            finish = {"type": "length", "length": n}
        else:
            finish = {"type": "abort", "message": getattr(f, "error", "aborted")}
        return {
            "text": "",
            "output_ids": f.token_ids,
            "meta_info": {
                "id": f.request_id,
                "prompt_tokens": len(f.prompt_ids),
                "completion_tokens": n,
                "finish_reason": finish,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(f.logprobs, f.token_ids)],
                "weight_version": spans[-1]["version"],
                "weight_versions": spans,
            },
        }

    def pause(self, body: Body) -> Body:
        mode = body.get("mode", "abort")
        if mode == "retract":
            raise _BadRequest(
                "mode: retract is not supported by the built-in engine (it would "
                "recompute prefixes); use in_place"
            )
        if mode not in ("in_place", "abort"):
            raise _BadRequest(f"mode: must be in_place, abort or retract, got {mode!r}")
        with self._between_steps():  # taken between steps: the step in progress completes first
            self.engine.pause()
            if mode == "abort":
                self._abort_all()
        return {"success": True, "message": f"paused ({mode})"}

    def resume(self, body: Body) -> Body:
        with self._between_steps():
            self.engine.resume()
            self.cond.notify_all()
        return {"success": True, "message": "continued"}

    def _abort_all(self) -> int:
        aborted = [self.engine.abort(rid) for rid in list(self._waiters)]
        self._deliver([f for f in aborted if f is not None])
        return len(aborted)

    def abort(self, body: Body) -> Body:
        with self._between_steps():
            if body.get("abort_all"):
                n = self._abort_all()
            else:
                f = self.engine.abort(str(body.get("rid", "")))
                n = 0 if f is None else 1
                self._deliver([f] if f else [])
            self.cond.notify_all()
        return {"success": True, "message": f"aborted {n} request(s)"}

    def init_group(self, body: Body) -> Body:

        try:
            name = body.get("group_name", "weight_update_group")
            if name in self._groups:
                raise _BadRequest(f"group_name: {name!r} already initialised")
            self._groups[name] = init_update_group(
                backend=body.get("backend", "nccl"),
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                rank=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=name,
            )
        except KeyError as e:
            raise _BadRequest(f"{e.args[0]}: required") from None
        except (RuntimeError, ValueError) as e:
            raise _BadRequest(f"Failed to initialize custom process group: {e}") from None
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: Body) -> Body:

        group = self._groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            raise _BadRequest("group_name: no such group")
        destroy_update_group(group)
        return {"success": True, "message": "destroyed"}

    def begin_update(self, body: Body) -> Body:
        self._session = True
        return {"success": True, "message": "weight-update session open"}

    def end_update(self, body: Body) -> Body:
        if not self._session:
            raise _BadRequest("no weight-update session is open; call begin_weight_update() first")
        self._session = False
        return {"success": True, "message": "weight-update session closed"}

    def update_weights(self, body: Body) -> Body:

        if not self._session:
            raise _BadRequest(
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        try:
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        except KeyError as e:
            raise _BadRequest(f"{e.args[0]}: required") from None
        group = self._groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            raise _BadRequest("group_name: call /init_weights_update_group first")
        params = self.engine.model.named_weights()
        bad = [n for n in names if n not in params]
        if bad:  # the sender broadcasts regardless: receive, then refuse (keeps the group in step)
            log.error("update_weights_from_distributed: unknown names %s", bad[:4])
        device = self.engine.cache.k.device
        if body.get("load_format") == "flattened_bucket":
            _, total = bucket_layout(dtypes, shapes)
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            broadcast(flat, group, src=0)
            tensors = unpack_bucket(names, dtypes, shapes, flat)
        elif body.get("load_format") is None:
            tensors = []
            for n, d, s in zip(names, dtypes, shapes):
                t = torch.empty(s, dtype=getattr(torch, d), device=device)
                broadcast(t, group, src=0)
                tensors.append((n, t))
        else:
            raise _BadRequest(f"load_format: {body['load_format']!r} is not supported")
        if bad:
            raise _BadRequest(f"names: not parameters of this model: {bad[:8]}")
        with self._between_steps():
            with torch.no_grad():
                for n, t in tensors:
                    p = params[n]
                    if tuple(t.shape) != tuple(p.shape):
                        raise _BadRequest(f"{n}: shape {list(t.shape)}, the model has {list(p.shape)}")
                    p.copy_(t)
            if body.get("weight_version") is not None:
                self.engine.set_version(_int_version(body["weight_version"]))
            self.stats["weight_updates"] += 1
        return {"success": True, "message": "Succeeded to update parameter online."}

    def flush_cache(self, body: Body) -> Body:
        return {"success": True, "message": "no prefix cache to flush"}

    def receive_raw(self, body: Body) -> Body:

        group = self._groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            raise _BadRequest("group_name: call /init_weights_update_group first")
        try:
            numel = int(body["numel"])
        except (KeyError, TypeError, ValueError):
            raise _BadRequest("numel: required, an integer number of bytes") from None
        if numel < 1:
            raise _BadRequest(f"numel: must be >= 1, got {numel}")
        broadcast(torch.empty(numel, dtype=torch.uint8, device=self.engine.cache.k.device), group, src=0)
        return {"success": True, "message": f"received {numel} bytes"}

    def update_version(self, body: Body) -> Body:
        with self._between_steps():
            if body.get("abort_all_requests", True):
                self._abort_all()
            self.engine.set_version(_int_version(body["new_version"]))
        return {"success": True, "message": "updated", "new_version": body["new_version"]}

    def server_info(self) -> Body:
        with self._between_steps():
            e = self.engine
            return {
                "version": SERVER_VERSION,
                "model_path": self.model_path,
                "max_total_num_tokens": e.capacity_tokens,
                "max_running_requests": e.config.max_slots,
                "context_length": e.config.max_len,
                "weight_version": str(e.version),
                "internal_states": [
                    {
                        "num_running_reqs": e.running,
                        "num_waiting_reqs": e.waiting,
                        "paused": e.paused,
                        "steps": self.stats["steps"],
                        "busy_s": self.stats["busy_s"],
                        "generated_tokens": self.stats["generated_tokens"],
                        "prefill_tokens": e.prefill_tokens,
                        "weight_updates": self.stats["weight_updates"],
                    }
                ],
            }

    def weights_digest(self) -> Body:
        with self._between_steps():
            return {n: tensor_digest(p) for n, p in self.engine.model.named_weights().items()}

    def health(self) -> Body:
        return {}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return host == "localhost"


def _int_version(v: JsonValue) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise _BadRequest(f"weight_version: the built-in engine takes integer versions, got {v!r}") from None


_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "max_new_tokens",
    "stop_token_ids",
    "sampling_seed",
    "skip_special_tokens",
    "no_stop_trim",
    "stop",
    "top_k",
    "n",
}


def _make_handler(server: EngineServer) -> type[BaseHTTPRequestHandler]:
    post: dict[str, Callable[[Body], Body | list[Body]]] = {
        path: getattr(server, name) for path, name in POST_ROUTES.items()
    }
    get: dict[str, Callable[[], Body]] = {path: getattr(server, name) for path, name in GET_ROUTES.items()}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

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
            self.wfile.write(data)

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

        def _dispatch(self, fn: Callable[..., object], *args: Body) -> None:
            try:
                self._send(HTTPStatus.OK, fn(*args))
            except _BadRequest as e:
                self._send(e.status, {"success": False, "message": str(e), "error": {"message": str(e)}})
            except Exception as e:
                log.exception("%s failed", self.path)
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    {"success": False, "message": f"{type(e).__name__}: {e}"},
                )

        def do_GET(self) -> None:
            if self._refused():
                return None
            fn = get.get(self.path.split("?")[0])
            if fn is None:
                return self._send(HTTPStatus.NOT_FOUND, {"message": f"no route {self.path}"})
            self._dispatch(fn)

        def do_POST(self) -> None:
            if self._refused():
                return None
            fn = post.get(self.path.split("?")[0])
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if fn is None:
                return self._send(HTTPStatus.NOT_FOUND, {"message": f"no route {self.path}"})
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as e:
                return self._send(HTTPStatus.BAD_REQUEST, {"message": f"bad JSON body: {e}"})
            self._dispatch(fn, body)

    return Handler


def main(argv: list[str] | None = None) -> int:
    """``megatron-rl serve-engine``: serve an HF folder until killed."""
    p = argparse.ArgumentParser(prog="megatron-rl serve-engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--max-slots", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-len", type=int, default=2048, help="prompt + completion tokens per slot")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--weight-version", type=int, default=0, help="version of the loaded weights")
    p.add_argument("--port-file", help="write the bound port here (atomic) once serving")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="every route but /health and /health_generate then wants 'Authorization: Bearer KEY' "
        f"(SGLang's flag); default ${API_KEY_ENV}, which unlike argv does not show in ps; "
        "neither: no key",
    )
    p.add_argument(
        "--timing-model",
        metavar="FILE.json",
        help="no model compute: steps sleep for this cost model and write its token "
        "script (generation/engine/timing.py); --model gives EOS and vocab only",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    try:
        api_key = check_api_key(args.api_key) if args.api_key is not None else api_key_from_env()
    except ValueError as e:
        print(f"serve-engine: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"serve-engine: {args.model}: no config.json (an HF model folder is expected)", file=sys.stderr)
        return 2
    if args.timing_model:
        with open(os.path.join(args.model, "config.json")) as f:
            hf = json.load(f)
        eos = hf.get("eos_token_id")
        engine: Engine | TimingEngine = TimingEngine.from_json(
            args.timing_model,
            EngineConfig(max_slots=args.max_slots, max_len=args.max_len),
            eos_token_ids=[] if eos is None else eos if isinstance(eos, list) else [eos],
            vocab_size=hf.get("vocab_size"),
        )
    else:
        engine = Engine.from_pretrained(
            args.model, EngineConfig(max_slots=args.max_slots, max_len=args.max_len)
        )
    engine.set_version(args.weight_version)
    server = EngineServer(engine, host=args.host, port=args.port, model_path=args.model, api_key=api_key)
    if args.port_file:
        atomic_write_text(args.port_file, str(server.port))
    log.info(
        "serving %s on %s (KV capacity %d tokens, %s)",
        args.model,
        server.url,
        engine.capacity_tokens,
        "API key required" if api_key else "no API key",
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
