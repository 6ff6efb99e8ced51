"""The built-in engine server: SGLang's HTTP API (the subset in ``generation/protocol.py``) over
the PyTorch :class:`~megatron_rl.generation.engine.Engine`.

    MEGATRON_RL_API_KEY=KEY megatron-rl serve-engine --model HF_FOLDER --port 30000 [--max-slots 16]

One thread runs the engine loop (admit, prefill, decode a step, hand finished requests back);
HTTP requests are served by a thread each (``ThreadingHTTPServer``) and wait on their own
request's completion. The engine lock is held for one whole step, so control requests (pause,
weight loads, abort) land *between* steps.

- ``/generate``: token ids in (``input_ids``, one list or a batch of lists), ``output_ids`` with
  ``meta_info.output_token_logprobs`` and ``weight_versions`` spans out. Text prompts are refused
  (the server has no tokenizer). ``stream``: replies as server-sent events, each sent as its
  request finishes (a batch's with their ``index``; no partial outputs). ``megatron_rl_flat_logprobs``
  (ours, advertised in ``/server_info``): ``meta_info.output_logprobs``, one float per token, instead
  of the triples, which take the client twice as long to read. ``sampling_params`` are read as SGLang
  0.5.23 reads them and checked as strictly: a key that is not SGLang's, a wrong type or range, a
  parameter we do not implement at other than its "off" value, or ``n`` other than 1 is a 400
  naming the field. So are the top-level fields (``engine/requests.py``): each is implemented,
  accepted where it changes nothing here (``priority``, ``log_metrics``, ...), or refused unless
  off (``lora_path``: no adapter is loaded here; ``return_hidden_states``, ...); a token id
  outside the vocabulary is a 400 naming ``input_ids[i][j]``. ``top_k`` -1 is no cut; a
  temperature below 1e-6 is greedy. A batch is checked whole and queued all or nothing. A client
  that disconnects while it waits has its requests aborted.
- ``/pause_generation`` ``in_place``: the loop stops after the step in progress; running requests
  keep their slots and KV cache. ``abort``: every request ends (``finish_reason`` abort) and the
  loop stops. ``retract`` is refused (it recomputes prefixes, which we never want).
  ``/continue_generation`` restarts the loop.
- ``/init_weights_update_group``: joins the update group (``generation/update_group.py``) as rank
  ``rank_offset`` (one worker per server); a master that accepts no connection within
  ``connect_timeout_s`` (10 s) is a 400 naming its ``master_address:master_port``.
  ``/begin_weight_update`` ... ``/end_weight_update`` bracket the updates, as SGLang 0.5.23
  requires. ``/update_weights_from_distributed``: receives
  one bucket (``flattened_bucket``) or one broadcast per tensor into fresh buffers, checks every
  tensor (name, shape, dtype, finite), and only then copies them into the model's HF-named
  parameters under the engine lock and, with ``weight_version``, sets the version that later
  tokens record: all or nothing, a 400 naming the first bad tensor otherwise. A tensor in a
  floating dtype other than its parameter's is cast (as SGLang), and the reply's ``dtype_casts``
  says which. The receive does not hold the lock: decoding goes on while bytes
  arrive unless the caller paused first. ``flush_cache`` has nothing to flush (no prefix cache;
  running requests keep their KV cache either way).
- ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/update_weights_from_tensor``:
  colocated mode, as SGLang (``engine/colocate.py``).
- ``/get_server_info``: ``max_total_num_tokens`` (KV capacity), ``max_running_requests``,
  ``context_length``, ``weight_version``, live counts in ``internal_states``.
- Extensions (not SGLang): ``GET /megatron_rl/weights_digest`` -> sha256 of every parameter's
  bytes, so a test or an operator can prove a server holds exactly the trainer's weights.
  ``POST /megatron_rl/receive_raw`` ``{"group_name": ..., "numel": N}`` receives one ``uint8``
  broadcast of N bytes from rank 0 of that update group and discards it (no session, no lock):
  the bare transport cost that ``tools/bench_weight_sync.py`` compares a weight update against.
  ``POST /megatron_rl/update_weights_stream``: a whole update's manifest in one message; the
  buckets follow as broadcasts with no HTTP per bucket, checked while the next arrives, applied
  all or nothing; ``/end_weight_update`` answers its outcome (``engine/weights.py``).

**API key**, as SGLang's ``--api-key`` (``sglang/srt/utils/auth.py``, 0.5.23): with a key
(``--api-key KEY``, or ``$MEGATRON_RL_API_KEY``, which unlike argv does not show in ``ps``) every
route but ``OPEN_ROUTES`` (the health checks, for probes), and any unknown path, wants
``Authorization: Bearer KEY``; otherwise the answer is 401 ``{"error": "Unauthorized"}`` and
nothing else happens: the body is read only to be discarded, never parsed. Without a key the
server is open, as SGLang's is, and says so in its log when it listens beyond loopback.

**Hygiene.** A body past ``--max-body-mb`` is answered 413 without being read; a bad
``Content-Length`` 400, a chunked body 411. Every error is JSON (``message``, ``error.message``);
an unexpected exception is a 500 ``internal error: <type>``, its traceback in the log only. Every
control route checks its whole body before it acts or waits (a rendezvous, a broadcast) and
answers a bad value with a 400 naming the field. A request must arrive whole within
``--read-timeout-s`` (line, headers and body together: 408 or closed past it), and one client
address holds at most ``--max-conns-per-client`` connections (503 past it), so stalled or
hoarding clients cannot starve the server of threads (``engine/http.py``). Every argument is
checked, and the port bound, before the model loads (``engine/serve_args.py``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from megatron_rl.errors import run_cli
from megatron_rl.generation.engine.colocate import ColocateRoutes
from megatron_rl.generation.engine.engine import Engine, EngineConfig, Finished
from megatron_rl.generation.engine.http import (
    DEFAULT_MAX_CONNS_PER_CLIENT,
    DEFAULT_READ_TIMEOUT_S,
    BadRequest,
    ClientGone,
    EngineHTTPServer,
    make_handler,
)
from megatron_rl.generation.engine.requests import GenerateBody, Job, parse_generate_body
from megatron_rl.generation.engine.serve_args import bind, parse_serve_args, write_port_file
from megatron_rl.generation.engine.timing import TimingEngine
from megatron_rl.generation.engine.updates import UpdateRoutes
from megatron_rl.generation.engine.weights import (
    ENGINE_CAPABILITY,
    STREAM_ROUTE,
    StreamReceiver,
)
from megatron_rl.generation.protocol import (
    API_KEY_ENV,
    FLAT_LOGPROBS,
    FLAT_LOGPROBS_FIELD,
    STREAMED_BATCH,
    check_api_key,
    tensor_digest,
)
from megatron_rl.generation.update_group import DEFAULT_CONNECT_TIMEOUT_S
from megatron_rl.hf.arch import language_model_dict

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
    "/weights_checker": "weights_checker",
    "/megatron_rl/receive_raw": "receive_raw",
    # Colocated mode (engine/colocate.py): free memory while the trainer runs, weights by reference.
    "/release_memory_occupation": "release_memory",
    "/resume_memory_occupation": "resume_memory",
    "/update_weights_from_tensor": "update_weights_from_tensor",
    STREAM_ROUTE: "update_weights_stream",
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

# How often a handler waiting for its generation looks whether its client is still connected:
# a disconnect is noticed within this, at one poll() per waiting request per interval.
_POLL_S = 1.0


class _Waiter:
    """One queued request's handle: ``event`` is set with its ``result``; in a streamed batch,
    its ``index`` also goes to the batch's ``ready`` queue."""

    __slots__ = ("event", "index", "ready", "result")

    def __init__(self, index: int = 0, ready: queue.SimpleQueue[int] | None = None) -> None:
        self.event = threading.Event()
        self.result: Finished | None = None
        self.index, self.ready = index, ready

    def finished(self) -> Finished:
        """The result, once ``event`` is set (``_deliver`` sets the result first)."""
        if self.result is None:
            raise RuntimeError("a request was marked done without a result")
        return self.result


class _Stream:
    """A streamed ``/generate``'s replies as its requests finish (see :meth:`EngineServer.generate`):
    each step of the iteration is everything finished since the last, in one list. Closed before
    the end (the client left, a write failed), it aborts what is still queued or running."""

    def __init__(
        self,
        server: EngineServer,
        jobs: list[Job],
        waiters: list[_Waiter],
        ready: queue.SimpleQueue[int],
        client_gone: Callable[[], bool],
        parsed: GenerateBody,
    ) -> None:
        self._server, self._jobs, self._waiters, self._ready = server, jobs, waiters, ready
        self._client_gone, self._parsed = client_gone, parsed
        self._left = len(waiters)

    def __iter__(self) -> _Stream:
        return self

    @property
    def ended(self) -> bool:
        return not self._left

    def __next__(self) -> list[Body]:
        if not self._left:
            raise StopIteration
        while True:
            try:
                done = [self._ready.get(timeout=_POLL_S)]
                break
            except queue.Empty:
                if self._client_gone():
                    self.close()
                    raise ClientGone from None
        while True:
            try:
                done.append(self._ready.get_nowait())
            except queue.Empty:
                break
        self._left -= len(done)
        replies = [self._server._reply(self._waiters[i].finished(), self._parsed) for i in done]
        if self._parsed.batch:
            for i, reply in zip(done, replies):
                reply["index"] = i
        return replies

    def close(self) -> None:
        if self._left:
            self._left = 0
            self._server._abandon([job.rid for job in self._jobs])


class EngineServer(UpdateRoutes, ColocateRoutes):
    """An :class:`Engine` behind SGLang-shaped HTTP routes. ``serve_forever`` blocks;
    ``start()`` serves from a daemon thread (tests), ``shutdown()`` stops both threads."""

    _route_error = BadRequest  # what the colocated-mode routes (ColocateRoutes) raise

    def __init__(
        self,
        engine: Engine | TimingEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "",
        api_key: str = "",
        max_body_mb: float = 64.0,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_conns_per_client: int = DEFAULT_MAX_CONNS_PER_CLIENT,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        httpd: EngineHTTPServer | None = None,
    ) -> None:
        """``api_key`` "": no key (every route open). ``max_body_mb``: the largest request body
        read; a larger one is answered 413 unread. ``read_timeout_s``: a request's read deadline
        (line, headers and body); ``max_conns_per_client``: connections per client address (0:
        no limit); see ``engine/http.py``. ``connect_timeout_s``: how long an update group's
        master may take to accept a connection (``/init_weights_update_group``). ``httpd``: a
        server already listening (``host``, ``port`` and the two limits are then its own)."""
        if not (math.isfinite(max_body_mb) and max_body_mb > 0):
            raise ValueError(f"max_body_mb: must be a finite number > 0, got {max_body_mb}")
        if not (math.isfinite(connect_timeout_s) and connect_timeout_s > 0):
            raise ValueError(f"connect_timeout_s: must be a finite number > 0, got {connect_timeout_s}")
        self._connect_timeout_s = connect_timeout_s
        self.engine = engine
        self._api_key = check_api_key(api_key).encode()
        self.max_body_bytes = int(max_body_mb * 2**20)
        self.model_path = model_path
        self.cond = threading.Condition()
        # Handlers waiting for the lock (see _between_steps); the engine loop yields to them.
        self._intents = 0
        self._intents_lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._session = False
        self._stream: StreamReceiver | None = None  # the streamed update being received, if any
        self._stream_lock = threading.Lock()  # one stream starts at a time, whatever races here
        self._stop = False
        self._rid_counter = 0
        self._paused_at = 0.0
        self.stats = {
            "steps": 0,
            "busy_s": 0.0,
            "paused_s": 0.0,  # paused by /pause_generation, until /continue_generation
            "generated_tokens": 0,
            "completions": 0,  # requests that ended, by any cause
            "weight_updates": 0,
            "aborted_requests": 0,  # by any cause: abort routes, pause(abort), a failed step, a client gone
            "client_disconnects": 0,  # requests aborted because their client closed the connection
        }
        if httpd is None:
            httpd = EngineHTTPServer(
                (host, port), read_timeout_s=read_timeout_s, max_conns_per_client=max_conns_per_client
            )
        httpd.RequestHandlerClass = make_handler(self, POST_ROUTES, GET_ROUTES)
        self.httpd = httpd
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
            self.stats["completions"] += 1
            self.stats["aborted_requests"] += f.finish_reason == "abort"
            w = self._waiters.pop(f.request_id, None)
            if w is not None:
                w.result = f
                w.event.set()
                if w.ready is not None:
                    w.ready.put(w.index)

    # ------------------------------------------------------------------ routes

    def generate(
        self, body: Body, client_gone: Callable[[], bool] = lambda: False
    ) -> Body | list[Body] | _Stream:
        """``/generate``: every prompt and its sampling parameters are checked before any is
        queued, and they are queued all or none (a batch with one bad prompt queues nothing).
        ``client_gone`` is polled while waiting: a client that left has its requests aborted.

        With ``stream``, the answer is an iterator that the handler sends as server-sent events:
        each time requests finish, their replies (a batch's with their ``index``, as SGLang's
        batch stream), so a group's short samples come back while its long ones still decode.
        Unlike SGLang, which also streams partial outputs every ``stream_interval`` tokens, only
        finished requests are sent: the RL loop has no use for partial ones."""
        parsed = parse_generate_body(body, vocab_size=self._vocab_size())
        jobs = parsed.jobs
        for job in jobs:
            job.rid = job.rid or self._next_rid()
        if parsed.stream:
            ready: queue.SimpleQueue[int] = queue.SimpleQueue()
            waiting = self._enqueue(jobs, parsed.return_routed_experts, ready)
            return _Stream(self, jobs, waiting, ready, client_gone, parsed)
        waiters = self._enqueue(jobs, parsed.return_routed_experts)
        for w in waiters:
            while not w.event.wait(_POLL_S):
                if client_gone():
                    self._abandon([job.rid for job in jobs])
                    raise ClientGone
        out = [self._reply(w.finished(), parsed) for w in waiters]
        return out if parsed.batch else out[0]

    def _vocab_size(self) -> int | None:
        """The model's vocabulary size (the timing engine's from its config; None: unknown)."""
        e = self.engine
        return e.model.cfg.vocab_size if isinstance(e, Engine) else e.vocab_size

    def _enqueue(
        self, jobs: list[Job], routed: bool, ready: queue.SimpleQueue[int] | None = None
    ) -> list[_Waiter]:
        """Queue every job in one lock section, or none: the engine's own checks (prompt ids in
        the vocabulary, prompt + max_new_tokens within max_len) refusing one undo the others
        before the engine loop can step them. ``routed``: record their routed experts."""
        waiters = []
        with self._between_steps():
            for job in jobs:
                if job.rid in self._waiters:
                    raise BadRequest(f"rid: {job.rid!r} is already in flight")
            added: list[str] = []
            try:
                for job in jobs:
                    sp = job.sampling
                    limit = sp.max_new_tokens  # null: up to the context length, as SGLang
                    if routed and not isinstance(self.engine, Engine):
                        raise ValueError("return_routed_experts: the timing engine routes no experts")
                    # The timing engine writes scripted tokens: no distribution for top_k to cut.
                    extra = (
                        {"top_k": sp.top_k, "return_routed_experts": routed}
                        if isinstance(self.engine, Engine)
                        else {}
                    )
                    self.engine.add_request(
                        job.rid,
                        job.prompt,
                        max_new_tokens=limit or self.engine.config.max_len - len(job.prompt),
                        temperature=sp.temperature,
                        top_p=sp.top_p,
                        seed=sp.seed,
                        stop_token_ids=sp.stop_token_ids,
                        **extra,  # type: ignore[arg-type]  # mypy cannot pair ** keys with parameters
                    )
                    added.append(job.rid)
            except (ValueError, TypeError) as e:
                for rid in added:
                    self.engine.abort(rid)
                raise BadRequest(f"prompt{job.where}: {e}" if job.where else str(e)) from None
            for i, job in enumerate(jobs):
                w = _Waiter(i, ready)
                self._waiters[job.rid] = w
                waiters.append(w)
            self.cond.notify_all()
        return waiters

    def _abandon(self, rids: list[str]) -> None:
        """Abort what is still queued or running of a request whose client went away."""
        with self._between_steps():
            aborted = [f for f in (self.engine.abort(rid) for rid in rids if rid in self._waiters) if f]
            self.stats["client_disconnects"] += len(aborted)
            self._deliver(aborted)
            for rid in rids:
                self._waiters.pop(rid, None)
        if aborted:
            log.info(
                "client left: aborted %d request(s) %s", len(aborted), [f.request_id for f in aborted][:4]
            )

    def _next_rid(self) -> str:
        with self._between_steps():
            self._rid_counter += 1
            return f"engine-{os.getpid()}-{self._rid_counter}"

    def _reply(self, f: Finished, parsed: GenerateBody | None = None) -> Body:
        """SGLang's ``/generate`` reply for ``f``; with ``parsed.flat_logprobs`` its log-probs as one
        list of floats (:data:`~megatron_rl.generation.protocol.FLAT_LOGPROBS`) instead of
        per-token triples; with ``return_routed_experts`` SGLang's ``meta_info.routed_experts``:
        base64 of the int32 ``[positions, layers, top_k]`` experts from
        ``routed_experts_start_len`` on."""
        flat = parsed is not None and parsed.flat_logprobs
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
        meta: Body = {
            "id": f.request_id,
            "prompt_tokens": len(f.prompt_ids),
            "completion_tokens": n,
            "finish_reason": finish,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
        }
        if flat:
            meta[FLAT_LOGPROBS_FIELD] = f.logprobs
        else:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(f.logprobs, f.token_ids)]
        if f.routed_experts is not None and parsed is not None:
            routed = f.routed_experts[parsed.routed_experts_start_len :].contiguous()
            meta["routed_experts"] = base64.b64encode(routed.numpy().tobytes()).decode("ascii")
        return {"text": "", "output_ids": f.token_ids, "meta_info": meta}

    def pause(self, body: Body) -> Body:
        mode = body.get("mode", "abort")
        if mode == "retract":
            raise BadRequest(
                "mode: retract is not supported by the built-in engine (it would "
                "recompute prefixes); use in_place"
            )
        if mode not in ("in_place", "abort"):
            raise BadRequest(f"mode: must be in_place, abort or retract, got {mode!r}")
        with self._between_steps():  # taken between steps: the step in progress completes first
            if not self.engine.paused:
                self._paused_at = time.perf_counter()
            self.engine.pause()
            if mode == "abort":
                self._abort_all()
        return {"success": True, "message": f"paused ({mode})"}

    def resume(self, body: Body) -> Body:
        flag = body.get("torch_empty_cache")  # SGLang's one field; no CUDA cache to empty here
        if flag is not None and not isinstance(flag, bool):
            raise BadRequest(f"torch_empty_cache: must be true or false, got {flag!r}")
        with self._between_steps():
            if self.engine.paused:
                self.stats["paused_s"] += time.perf_counter() - self._paused_at
            self.engine.resume()
            self.cond.notify_all()
        return {"success": True, "message": "continued"}

    def _abort_all(self) -> int:
        aborted = [self.engine.abort(rid) for rid in list(self._waiters)]
        self._deliver([f for f in aborted if f is not None])
        return len(aborted)

    def abort(self, body: Body) -> Body:
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if rid is None or (isinstance(rid, int) and not isinstance(rid, bool)):
            rid = "" if rid is None else str(rid)
        if not isinstance(rid, str):
            raise BadRequest(f"rid: must be a string, got {rid!r}")
        if not isinstance(abort_all, bool):
            raise BadRequest(f"abort_all: must be true or false, got {abort_all!r}")
        with self._between_steps():
            if abort_all:
                n = self._abort_all()
            else:
                f = self.engine.abort(rid)
                n = 0 if f is None else 1
                self._deliver([f] if f else [])
            self.cond.notify_all()
        return {"success": True, "message": f"aborted {n} request(s)"}

    def flush_cache(self, body: Body) -> Body:
        t = body.get("timeout_s")  # SGLang's one field
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0):
            raise BadRequest(f"timeout_s: must be a number >= 0 or null, got {t!r}")
        return {"success": True, "message": "no prefix cache to flush"}

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
                **self.memory_state(),  # colocated mode: released tags, weights_loaded
                ENGINE_CAPABILITY: STREAM_ROUTE,  # takes streamed weight updates (engine/weights.py)
                STREAMED_BATCH: True,  # streams a batch's finished items only (generate)
                FLAT_LOGPROBS: True,  # log-probs as one list of floats when asked (generate)
                # One process holds the whole model: one rank of the weight-update group.
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "internal_states": [
                    {
                        "num_running_reqs": e.running,
                        "num_waiting_reqs": e.waiting,
                        "paused": e.paused,
                        "steps": self.stats["steps"],
                        "busy_s": self.stats["busy_s"],
                        "paused_s": self.stats["paused_s"]
                        + (time.perf_counter() - self._paused_at if e.paused else 0.0),
                        "generated_tokens": self.stats["generated_tokens"],
                        "completions": self.stats["completions"],
                        "prefill_tokens": e.prefill_tokens,
                        "weight_updates": self.stats["weight_updates"],
                        "aborted_requests": self.stats["aborted_requests"],
                        "client_disconnects": self.stats["client_disconnects"],
                        # TCP connections served and refused (over --max-conns-per-client)
                        "connections": self.httpd.accepted_connections,
                        "refused_connections": self.httpd.refused_connections,
                    }
                ],
            }

    def weights_digest(self) -> Body:
        with self._between_steps():
            return {n: tensor_digest(p) for n, p in self.engine.model.named_weights().items()}

    def weights_checker(self, body: Body) -> Body:
        """SGLang's ``/weights_checker`` reply shape for ``action: checksum`` (the one action we
        use): a checksum per parameter and one over them all, for our single worker."""
        action = body.get("action", "checksum")
        if action != "checksum":
            raise BadRequest(f"action: only 'checksum' is supported, got {action!r}")
        checksums = self.weights_digest()
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode() + checksums[name].encode())
        per_gpu = overall.hexdigest()
        placement = dict(role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1)
        rank = {
            "checksums": checksums,
            "per_gpu_checksum": per_gpu,
            "parallelism_info": [{**placement, "rank": 0, "size": 1}],
        }
        engine = hashlib.sha256(per_gpu.encode()).hexdigest()
        return {"success": True, "message": "", "ranks": [rank], "per_engine_checksum": engine}

    def health(self) -> Body:
        return {}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return host == "localhost"


def _raise_open_files_limit() -> None:
    """Open files up to the hard limit: a connection is a descriptor, and a soft limit of 1024
    (common) would refuse a fleet's thousand concurrent requests."""
    try:
        import resource  # lazy: POSIX only
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    """``megatron-rl serve-engine``: serve an HF folder until killed. Every argument is checked
    and the port bound before the model loads (``engine/serve_args.py``)."""
    args = parse_serve_args(argv)
    httpd = bind(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(max_slots=args.max_slots, max_len=args.max_len)
    if args.timing is not None:
        text = language_model_dict(args.hf_config)  # a vision-language config: its language model's
        eos = text.get("eos_token_id")
        vocab = text.get("vocab_size")
        engine: Engine | TimingEngine = TimingEngine(
            args.timing,
            config,
            eos_token_ids=[] if eos is None else eos if isinstance(eos, list) else [eos],
            vocab_size=vocab if isinstance(vocab, int) else None,
        )
    else:
        engine = Engine.from_pretrained(args.model, config)
    engine.set_version(args.weight_version)
    _raise_open_files_limit()
    server = EngineServer(
        engine, model_path=args.model, api_key=args.api_key, max_body_mb=args.max_body_mb, httpd=httpd
    )
    if args.port_file:
        write_port_file(args.port_file, server.port)
    log.info(
        "serving %s on %s (KV capacity %d tokens, %s; read deadline %g s, %s connections per client)",
        args.model,
        server.url,
        engine.capacity_tokens,
        "API key required" if args.api_key else "no API key",
        args.read_timeout_s,
        args.max_conns_per_client or "unlimited",
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl serve-engine", main))
