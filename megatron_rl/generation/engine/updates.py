"""The weight-update routes of the built-in engine server, SGLang 0.5.23's and our streamed one:
``/init_weights_update_group``, ``/destroy_weights_update_group``, ``/begin_weight_update``,
``/end_weight_update``, ``/update_weights_from_distributed``, ``/update_weight_version``, and the
extensions ``/megatron_rl/update_weights_stream`` and ``/megatron_rl/receive_raw``.

:class:`UpdateRoutes` is a base class of :class:`~.server.EngineServer`. Every update is checked
before it changes anything: a body is checked before a byte of the broadcast is received, and the
received tensors (``weights.checked_update``) before any is copied in, in one section between
engine steps; a bad one is a 400 naming it, with the weights and the version untouched. The
streamed update's manifest, receiver and all-or-nothing apply are in ``engine/weights.py``.

Every number a body carries has a range, checked first: versions in ``[0, 2**63 - 1]`` (they feed
the staleness metrics, and ``--weight-version`` takes the same), ports, ranks, world sizes and
byte counts (see :func:`_group_spec`, :func:`_update_spec`, ``receive_raw``). Joining an update
group whose master does not answer fails within the server's ``connect_timeout_s``, naming the
``master_address:master_port`` (``generation/update_group.py``).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from http import HTTPStatus
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.generation.engine.http import BadRequest
from megatron_rl.generation.engine.routes import ServerServices
from megatron_rl.generation.engine.weights import (
    STREAM_ROUTE,
    ManifestError,
    StreamReceiver,
    cast_note,
    checked_update,
    dtype_casts,
    install,
    parse_manifest,
    version_of,
)
from megatron_rl.generation.protocol import bucket_layout, unpack_bucket
from megatron_rl.generation.update_group import (
    DEFAULT_CONNECT_TIMEOUT_S,
    broadcast,
    destroy_update_group,
    init_update_group,
)

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.engine.engine import Engine
    from megatron_rl.generation.engine.timing import TimingEngine

    Body = dict[str, JsonValue]

__all__ = ["UpdateRoutes", "int_version"]

log = logging.getLogger("megatron_rl.engine_server")

# The longest /end_weight_update waits for a streamed update still arriving: past the update
# group's own timeout (init_update_group's 120 s), by when a stalled broadcast has failed.
_STREAM_WAIT_S = 300.0


class UpdateRoutes(ServerServices):
    """The weight-update routes of :class:`~.server.EngineServer` (see the module docstring).

    The server provides what is declared here: its engine and stats, the update groups by name,
    the weight-update session flag, the streamed update being received and the lock that starts
    one at a time, the engine lock (taken through ``_between_steps``) and ``_abort_all``.
    ``_connect_timeout_s``: how long a group's master may take to accept a connection."""

    _connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    engine: Engine | TimingEngine
    stats: dict[str, float]
    _groups: dict[str, dist.ProcessGroup]
    _session: bool
    _stream: StreamReceiver | None
    _stream_lock: threading.Lock

    def init_group(self, body: Body) -> Body:
        """Join the update group. Every field is checked before the rendezvous (which waits up
        to the group's timeout for rank 0): a bad one is a 400 naming it, at once. A master that
        accepts no connection within ``_connect_timeout_s`` is a 400 naming its address."""
        spec = _group_spec(body, self.engine.cache.k.device)
        if spec["group_name"] in self._groups:
            raise BadRequest(f"group_name: {spec['group_name']!r} already initialised")
        try:
            self._groups[str(spec["group_name"])] = init_update_group(
                backend=str(spec["backend"]),
                master_address=str(spec["master_address"]),
                master_port=int(spec["master_port"]),
                rank=int(spec["rank_offset"]),
                world_size=int(spec["world_size"]),
                group_name=str(spec["group_name"]),
                connect_timeout_s=self._connect_timeout_s,
            )
        except (RuntimeError, ValueError, TypeError, ConnectionError) as e:
            raise BadRequest(f"Failed to initialize custom process group: {e}") from None
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: Body) -> Body:
        name = _group_name(body)
        group = self._groups.pop(name, None)
        if group is None:
            raise BadRequest(f"group_name: no such group {name!r}")
        destroy_update_group(group)
        return {"success": True, "message": "destroyed"}

    def begin_update(self, body: Body) -> Body:
        self._session = True
        return {"success": True, "message": "weight-update session open"}

    def end_update(self, body: Body) -> Body:
        """Close the session; a streamed update still arriving is waited for first, and its
        outcome is the answer (400 / 500 naming what was wrong: nothing was applied)."""
        if not self._session:
            raise BadRequest("no weight-update session is open; call begin_weight_update() first")
        stream = self._stream
        if stream is not None:
            result = stream.wait(_STREAM_WAIT_S)
            if result is None:
                raise BadRequest(
                    f"the streamed update is still arriving after {_STREAM_WAIT_S:g} s; "
                    "nothing was applied yet",
                    HTTPStatus.SERVICE_UNAVAILABLE,
                )
            self._stream = None
            self._session = False
            if result.status != HTTPStatus.OK:
                log.error("streamed weight update refused: %s", result.message)
                raise BadRequest(result.message, result.status)
            return {"success": True, "message": result.message, "stream": dict(result.timings)}
        self._session = False
        return {"success": True, "message": "weight-update session closed"}

    def _no_stream(self, route: str) -> None:
        """Refuse ``route`` while a streamed update owns the update group's broadcasts."""
        if self._stream is not None and not self._stream.done():
            raise BadRequest(f"{route}: a streamed weight update is being received; end it first")

    def update_weights_stream(self, body: Body) -> Body:
        """``/megatron_rl/update_weights_stream``: check a whole update's manifest against the
        model (400 naming the field, before any broadcast), then receive its buckets on a thread
        of its own and answer at once that the server is ready. Opens the weight-update session
        if none is open; ``/end_weight_update`` answers the outcome (``engine/weights.py``)."""
        with self._stream_lock:
            return self._start_stream(body)

    def _start_stream(self, body: Body) -> Body:
        self._no_stream(STREAM_ROUTE)
        if self._stream is not None:  # a finished stream nobody ended: its outcome is dropped
            log.warning("a streamed update ended without /end_weight_update: %s", self._stream.result)
            self._stream = None
        params = self.engine.model.named_weights()
        try:
            group_name, version, buckets = parse_manifest(body, params)
        except ManifestError as e:
            raise BadRequest(f"{e}; nothing will be received") from None
        group = self._groups.get(group_name)
        if group is None:
            raise BadRequest("group_name: call /init_weights_update_group first")

        def apply(tensors: list[tuple[str, torch.Tensor]], version: int) -> float:
            with self._between_steps():
                t0 = time.perf_counter()
                install(params, tensors)
                self.engine.weights_changed(version)
                self.stats["weight_updates"] += 1
                return time.perf_counter() - t0

        self._session = True
        self._stream = StreamReceiver(
            group=group,
            buckets=buckets,
            params=params,
            version=version,
            device=self.engine.cache.k.device,
            apply=apply,
        ).start()
        n = sum(len(b.names) for b in buckets)
        return {"success": True, "message": "ready", "buckets": len(buckets), "tensors": n}

    def update_weights(self, body: Body) -> Body:
        """All or nothing: the whole broadcast is received into fresh buffers, then every tensor
        is checked (a parameter of this model, named once, its shape, a floating dtype, finite
        values in the parameter's dtype), and only then copied in, in one section between
        steps. A bad tensor: 400 naming the first, weights and weight version untouched. A
        floating tensor in another dtype than its parameter's is cast, as SGLang casts it (the
        trainer's ``weight_sync.cast_dtype`` relies on it), and the reply says so: ``dtype_casts``
        counts each pair of dtypes and the message names the first tensor of each.

        The body itself is checked before anything is received (a broadcast of unknown size
        cannot be received); past that the server takes part in the broadcast whatever the
        tensors turn out to be, so the sender, which broadcasts regardless, is never left waiting.
        """
        self._no_stream("/update_weights_from_distributed")
        if not self._session:
            raise BadRequest(
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        params = self.engine.model.named_weights()
        names, dtypes, shapes, flattened = _update_spec(body, params)
        version = None if body.get("weight_version") is None else int_version(body["weight_version"])
        abort_all = _flag(body, "abort_all_requests", False)
        _flag(body, "flush_cache", True)  # no prefix cache to flush
        if body.get("selector", "all") not in (None, "all", "target"):
            raise BadRequest(
                f"selector: {body['selector']!r}: this server has no draft model (all or target)"
            )
        group = self._groups.get(_group_name(body))
        if group is None:
            raise BadRequest("group_name: call /init_weights_update_group first")
        device = self.engine.cache.k.device
        try:
            if flattened:
                _, total = bucket_layout(dtypes, shapes)
                flat = torch.empty(total, dtype=torch.uint8, device=device)
                broadcast(flat, group, src=0)
                received = unpack_bucket(names, dtypes, shapes, flat)
            else:
                received = []
                for n, d, shape in zip(names, dtypes, shapes):
                    t = torch.empty(shape, dtype=getattr(torch, d), device=device)
                    broadcast(t, group, src=0)
                    received.append((n, t))
        except RuntimeError as e:  # the group broke (a peer died): nothing was applied
            raise BadRequest(f"group_name: the broadcast failed: {str(e)[:300]}", 500) from None
        tensors, errors = checked_update(received, params)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            log.error("update_weights_from_distributed refused: %s%s", errors[0], more)
            raise BadRequest(f"{errors[0]}{more}; nothing was applied")
        casts = dtype_casts(((n, t.dtype) for n, t in received), params)
        with self._between_steps():
            if abort_all:
                self._abort_all()
            with torch.no_grad():
                for n, t in tensors:
                    params[n].copy_(t)
            self.engine.weights_changed(version)
            self.stats["weight_updates"] += 1
        note = cast_note(casts)
        if note:
            log.info("update_weights_from_distributed:%s", note)
        return {
            "success": True,
            "message": f"Succeeded to update parameter online.{note}",
            "dtype_casts": {pair: len(names) for pair, names in casts.items()},
        }

    def receive_raw(self, body: Body) -> Body:
        self._no_stream("/megatron_rl/receive_raw")
        name = _group_name(body)
        # As much as a whole update of this model in float32, and a GiB at least (the timing
        # engine holds no weights): the bench sends one bucket or one model's bytes.
        params = self.engine.model.named_weights()
        most = max(4 * sum(p.numel() for p in params.values()), 1 << 30)
        numel = _int_field(body, "numel", lo=1, hi=most, what=" bytes")
        group = self._groups.get(name)
        if group is None:
            raise BadRequest("group_name: call /init_weights_update_group first")
        broadcast(torch.empty(numel, dtype=torch.uint8, device=self.engine.cache.k.device), group, src=0)
        return {"success": True, "message": f"received {numel} bytes"}

    def update_version(self, body: Body) -> Body:
        if body.get("new_version") is None:
            raise BadRequest("new_version: required")
        version = int_version(body["new_version"], "new_version")
        abort_all = _flag(body, "abort_all_requests", True)
        with self._between_steps():
            if abort_all:
                self._abort_all()
            self.engine.set_version(version)
        return {"success": True, "message": "updated", "new_version": body["new_version"]}


def int_version(v: JsonValue, field: str = "weight_version") -> int:
    """:func:`~megatron_rl.generation.engine.weights.version_of` as a 400 naming ``field``."""
    try:
        return version_of(v, field)
    except ManifestError as e:
        raise BadRequest(str(e)) from None


def _group_name(body: Body) -> str:
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"group_name: must be a non-empty string, got {name!r}")
    return name


def _flag(body: Body, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key}: must be true or false, got {v!r}")
    return v


def _int_field(body: Body, key: str, *, lo: int, hi: int, what: str = "") -> int:
    """An integer field in ``[lo, hi]`` (a string of digits counts, as pydantic reads SGLang's)."""
    if key not in body or body[key] is None:
        raise BadRequest(f"{key}: required, an integer in [{lo}, {hi}]{what}")
    v = body[key]
    digits = v[1:] if isinstance(v, str) and v.startswith("-") else v
    if isinstance(digits, str) and 0 < len(digits) <= 20 and digits.isascii() and digits.isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"{key}: must be an integer in [{lo}, {hi}]{what}, got {v!r}")
    return v


# The update-group backends: gloo (CPU tensors, or CUDA through the host) and nccl (CUDA).
_BACKENDS = ("gloo", "nccl")


def _group_spec(body: Body, device: torch.device) -> dict[str, str | int]:
    """The fields of an ``/init_weights_update_group`` body, checked (``BadRequest`` naming the
    first bad one): nothing the rendezvous would only find out by waiting for its timeout."""
    name = _group_name(body)
    backend = body.get("backend", "nccl")
    if backend not in _BACKENDS:
        raise BadRequest(f"backend: must be one of {', '.join(_BACKENDS)}, got {backend!r}")
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise BadRequest(f"backend: nccl needs a CUDA device; this engine runs on {device.type}: use gloo")
    if backend == "gloo" and not dist.is_gloo_available():
        raise BadRequest("backend: this torch build has no gloo; use nccl")
    address = body.get("master_address")
    if not isinstance(address, str) or not address or any(c.isspace() for c in address):
        raise BadRequest(f"master_address: required, a host name or address, got {address!r}")
    port = _int_field(body, "master_port", lo=1, hi=65535)
    world = _int_field(body, "world_size", lo=2, hi=1 << 20, what=" (the trainer and the servers)")
    rank = _int_field(body, "rank_offset", lo=1, hi=world - 1, what=" (rank 0 is the trainer)")
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise BadRequest(f"master_address: {address!r} does not resolve ({e})") from None
    return {
        "group_name": name,
        "backend": str(backend),
        "master_address": address,
        "master_port": port,
        "world_size": world,
        "rank_offset": rank,
    }


def _update_spec(
    body: Body, params: dict[str, torch.Tensor]
) -> tuple[list[str], list[str], list[list[int]], bool]:
    """``names, dtypes, shapes, flattened`` of an ``/update_weights_from_distributed`` body,
    checked before anything is received; ``BadRequest`` naming the field otherwise. Bounded by
    the model (no tensor larger than its largest parameter, no more tensors than it has), so a
    typo'd shape is refused by name instead of becoming an allocation the size of the machine
    and a receive that waits for bytes nobody sends."""
    try:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    except KeyError as e:
        raise BadRequest(f"{e.args[0]}: required") from None
    for key, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(v, list) or not v:
            raise BadRequest(f"{key}: must be a non-empty list")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(
            f"names / dtypes / shapes: one each per tensor, got {len(names)} / {len(dtypes)} / {len(shapes)}"
        )
    # The timing engine holds no weights: its bounds are only there to stop absurd sizes.
    most_tensors = len(params) or 1 << 16
    most_numel = max((p.numel() for p in params.values()), default=1 << 30)
    if len(names) > most_tensors:
        raise BadRequest(f"names: {len(names)} tensors, more than this model's {most_tensors} parameters")
    for i, (n, d, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(n, str) or not n:
            raise BadRequest(f"names[{i}]: must be a parameter name, got {n!r}")
        if not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype):
            raise BadRequest(f"dtypes[{i}]: not a torch dtype: {d!r} ({n})")
        if not isinstance(shape, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape
        ):
            raise BadRequest(f"shapes[{i}]: must be a list of sizes >= 0, got {shape!r} ({n})")
        if math.prod(shape) > most_numel:
            raise BadRequest(
                f"shapes[{i}]: {math.prod(shape)} elements, more than this model's largest "
                f"parameter ({most_numel}) ({n})"
            )
    load_format = body.get("load_format")
    if load_format not in (None, "flattened_bucket"):
        raise BadRequest(f"load_format: {load_format!r} is not supported (null or flattened_bucket)")
    if load_format is not None:
        try:
            bucket_layout(dtypes, shapes)
        except ValueError as e:
            raise BadRequest(str(e)) from None
    return names, dtypes, shapes, load_format is not None
