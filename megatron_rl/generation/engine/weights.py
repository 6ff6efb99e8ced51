"""The built-in engine's weight updates: the checks every received tensor passes, and the
streamed update (one control message for the whole update, not one per bucket).

**Streamed update** (an extension of the built-in engine; SGLang servers keep the per-bucket
``/update_weights_from_distributed``). The trainer posts the whole update's manifest once::

    POST /megatron_rl/update_weights_stream
    {"group_name": "...", "weight_version": 7,
     "buckets": [{"names": [...], "dtypes": [...], "shapes": [[...], ...]}, ...]}

The server checks all of it against its model before a byte is broadcast (every name a parameter,
named once in the whole update, its shape, a floating dtype, the flattened-bucket alignment), and
answers 400 naming the field -- so a malformed update never leaves the trainer waiting in a
broadcast. Otherwise it starts a receiver thread and answers ``ready``; the trainer then
broadcasts the buckets back to back, each a flat ``uint8`` tensor in ``protocol.pack_bucket``'s
layout followed by an 8-byte trailer (:data:`TRAILER_BYTES`): ``STREAM_CONTINUE``, or
``STREAM_ABORT`` when the trainer cannot finish the update (it sends no bucket after that one).
The receiver checks bucket k (finite values in the parameter's dtype, :func:`checked_update`) on
a second thread while bucket k+1 arrives, keeps every bucket, and applies the whole update at the
end in one section between engine steps, the received buffers becoming the parameters' storage
(no final copy). Anything wrong -- a NaN, an abort trailer, a broadcast that fails because the
trainer died -- applies nothing: the server keeps serving the old weights and version.
The engine goes on decoding while the update arrives (the trainer need not pause it): on a GPU
the receiver and its checker enqueue on a CUDA stream of their own, so the broadcast's wait never
holds the engine's kernels back, and that stream is synchronised before the swap.
``/end_weight_update`` waits for the receiver and answers its outcome (400 naming the first bad
tensor, 500 when the broadcast failed), with its timings under ``stream``.

Memory: all or nothing means the whole update is held before it is applied, a second copy of
the weights while it arrives; the old weights are freed when the new ones take their place.
A trainer that dies mid-update closes its sockets, so the receive fails at once; one that stalls
without dying is waited for up to the update group's timeout. Refusing a manifest is a per-server
decision: were one server of a fleet to refuse what another accepted (different models), the one
that accepted waits for the broadcast until that timeout, then reports the failure.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_rl.generation.protocol import bucket_layout, dtype_name, unpack_bucket
from megatron_rl.generation.update_group import broadcast

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatron_rl.fileio import JsonValue

__all__ = [
    "ENGINE_CAPABILITY",
    "MAX_VERSION",
    "STREAM_ABORT",
    "STREAM_CONTINUE",
    "STREAM_ROUTE",
    "TRAILER_BYTES",
    "BucketSpec",
    "ManifestError",
    "StreamReceiver",
    "StreamResult",
    "cast_note",
    "checked_update",
    "dtype_casts",
    "install",
    "parse_manifest",
    "read_trailer",
    "stream_payload",
    "version_of",
    "write_trailer",
]

STREAM_ROUTE = "/megatron_rl/update_weights_stream"
#: The ``/server_info`` key by which a server says it takes streamed updates (value: the route).
ENGINE_CAPABILITY = "megatron_rl_weight_stream"
TRAILER_BYTES = 8  # one int64 after each bucket's bytes
STREAM_CONTINUE = 0
STREAM_ABORT = 1
_MAX_BUCKETS = 1 << 16


class ManifestError(ValueError):
    """A streamed update's manifest that cannot be received; the message names the field."""


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of a streamed update: its tensors in flattened-bucket order and byte size."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int  # payload bytes, without the trailer


def stream_payload(
    *, group_name: str, weight_version: int, buckets: Sequence[BucketSpec]
) -> dict[str, object]:
    """The ``/megatron_rl/update_weights_stream`` body for a whole update."""
    return {
        "group_name": group_name,
        "weight_version": int(weight_version),
        "buckets": [
            {"names": list(b.names), "dtypes": list(b.dtypes), "shapes": [list(s) for s in b.shapes]}
            for b in buckets
        ],
    }


def write_trailer(buf: torch.Tensor, at: int, status: int) -> None:
    """Write ``status`` as the 8-byte trailer at byte ``at`` of the flat ``uint8`` ``buf``."""
    buf[at : at + TRAILER_BYTES].copy_(torch.tensor([status], dtype=torch.int64).view(torch.uint8))


def read_trailer(flat: torch.Tensor, at: int) -> int:
    """The trailer at byte ``at`` of a received bucket (copied out: ``at`` need not be aligned)."""
    return int(flat[at : at + TRAILER_BYTES].cpu().clone().view(torch.int64).item())


MAX_VERSION = 2**63 - 1  # a signed 64-bit integer: what a staleness metric and SGLang's int take


def version_of(v: JsonValue, field: str = "weight_version") -> int:
    """A weight version in ``[0, MAX_VERSION]``: an integer, or a string of its digits (SGLang's
    versions are strings; ours are their integers); :class:`ManifestError` naming ``field``
    otherwise (a bool, a float such as 1.5, a negative or a 70-bit number). One rule for every
    route that sets a version: streamed, colocated and ``/update_weight_version``."""
    n: int | None = None
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, str) and 0 < len(v) <= 20 and v.isascii() and v.isdigit():
        n = int(v)  # ASCII digits only: int() also reads "+7", " 7", "7_0" and other scripts' digits
    if n is None or not 0 <= n <= MAX_VERSION:
        raise ManifestError(
            f"{field}: the built-in engine takes integer versions in [0, 2**63 - 1] "
            f"(or a string of their digits), got {v!r}"
        )
    return n


def parse_manifest(
    body: dict[str, JsonValue], params: dict[str, torch.Tensor]
) -> tuple[str, int, list[BucketSpec]]:
    """``group_name, weight_version, buckets`` of a streamed update, checked against the model's
    ``params`` before anything is received; :class:`ManifestError` naming the first bad field."""
    group_name = body.get("group_name", "weight_update_group")
    if not isinstance(group_name, str) or not group_name:
        raise ManifestError(f"group_name: must be a non-empty string, got {group_name!r}")
    if body.get("weight_version") is None:
        raise ManifestError("weight_version: required")
    version = version_of(body["weight_version"])
    buckets = body.get("buckets")
    if not isinstance(buckets, list) or not buckets:
        raise ManifestError("buckets: must be a non-empty list of {names, dtypes, shapes}")
    if len(buckets) > _MAX_BUCKETS:
        raise ManifestError(f"buckets: at most {_MAX_BUCKETS}, got {len(buckets)}")
    seen: set[str] = set()
    specs = [_bucket_spec(b, f"buckets[{k}]", params, seen) for k, b in enumerate(buckets)]
    return group_name, version, specs


def _bucket_spec(b: JsonValue, at: str, params: dict[str, torch.Tensor], seen: set[str]) -> BucketSpec:
    """One manifest bucket, checked (``seen``: names of the buckets before it)."""
    if not isinstance(b, dict):
        raise ManifestError(f"{at}: must be an object with names, dtypes and shapes")
    lists = []
    for key in ("names", "dtypes", "shapes"):
        v = b.get(key)
        if not isinstance(v, list) or not v:
            raise ManifestError(f"{at}.{key}: must be a non-empty list")
        lists.append(v)
    names, dtypes, shapes = lists
    if not len(names) == len(dtypes) == len(shapes):
        raise ManifestError(
            f"{at}: one name, dtype and shape per tensor, got {len(names)} / {len(dtypes)} / {len(shapes)}"
        )
    for i, (n, d, s) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(n, str) or n not in params:
            raise ManifestError(f"{at}.names[{i}]: {n!r} is not a parameter of this model")
        if n in seen:
            raise ManifestError(f"{at}.names[{i}]: {n} is sent twice in one update")
        seen.add(n)
        dt = getattr(torch, d, None) if isinstance(d, str) else None
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ManifestError(f"{at}.dtypes[{i}]: not a floating torch dtype: {d!r} ({n})")
        if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in s):
            raise ManifestError(f"{at}.shapes[{i}]: must be a list of sizes, got {s!r} ({n})")
        if tuple(s) != tuple(params[n].shape):
            raise ManifestError(f"{at}.shapes[{i}]: {n} has shape {s}, the model has {list(params[n].shape)}")
    try:
        _, nbytes = bucket_layout(dtypes, shapes)
    except ValueError as e:
        raise ManifestError(f"{at}: {e}") from None
    return BucketSpec(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), nbytes)


def checked_update(
    received: list[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """The received tensors in their parameters' dtypes, and what is wrong with them, in order.

    A floating tensor is cast to its parameter's dtype (as SGLang's loaders ``copy_`` it: the
    trainer's fp32 norms go into a bf16 engine), and the cast value must be finite: an fp32 value
    past float16's range is as bad as a NaN. A tensor already in its parameter's dtype comes back
    as itself (no copy).
    """
    out: list[tuple[str, torch.Tensor]] = []
    errors: list[str] = []
    seen: set[str] = set()
    for n, t in received:
        p = params.get(n)
        if p is None:
            errors.append(f"{n}: not a parameter of this model")
        elif n in seen:
            errors.append(f"{n}: sent twice in one update")
        elif tuple(t.shape) != tuple(p.shape):
            errors.append(f"{n}: shape {list(t.shape)}, the model has {list(p.shape)}")
        elif not t.is_floating_point():
            errors.append(f"{n}: dtype {t.dtype} is not floating point (the parameter is {p.dtype})")
        else:
            v = t if t.dtype == p.dtype else t.to(p.dtype)
            # One read pass: a NaN or infinity makes the sum NaN or infinite (IEEE), so a finite
            # sum clears the tensor; a non-finite one (or finite values that overflow) is counted.
            if not bool(torch.isfinite(v.sum())) and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                errors.append(f"{n}: {bad} of {v.numel()} values are NaN or infinite in {p.dtype}")
            out.append((n, v))
        seen.add(n)
    return out, errors


def dtype_casts(
    sent: Iterable[tuple[str, torch.dtype]], params: dict[str, torch.Tensor]
) -> dict[str, list[str]]:
    """Which tensors of an update arrive in a dtype other than their parameter's (and are cast,
    as SGLang's loaders ``copy_`` them): ``"float16 -> float32"`` -> their names, in order.

    Casting is SGLang's behaviour and what ``weight_sync.cast_dtype`` relies on (a bf16 stream
    into an fp32 engine); it is reported, not refused, so a sender that did not mean it sees it."""
    casts: dict[str, list[str]] = {}
    for n, dtype in sent:
        p = params.get(n)
        if p is not None and dtype.is_floating_point and dtype != p.dtype:
            casts.setdefault(f"{dtype_name(dtype)} -> {dtype_name(p.dtype)}", []).append(n)
    return casts


def cast_note(casts: dict[str, list[str]]) -> str:
    """One sentence for a reply's message saying what was cast ("" when nothing was)."""
    if not casts:
        return ""
    parts = [f"{len(names)} tensor(s) {pair} (first {names[0]})" for pair, names in casts.items()]
    return f" Cast to the model's dtype: {'; '.join(parts)}."


@dataclass
class StreamResult:
    """The outcome of one streamed update (``status`` 200: applied)."""

    status: int = 200
    message: str = "applied"
    timings: dict[str, float] = field(default_factory=dict)


class StreamReceiver:
    """Receives one streamed update on a thread of its own; see the module docstring.

    ``apply(tensors, version)`` is called once, with every checked tensor, only when all of them
    arrived and passed; it installs them (under the engine lock) and returns its seconds.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        buckets: list[BucketSpec],
        params: dict[str, torch.Tensor],
        version: int,
        device: torch.device,
        apply: Callable[[list[tuple[str, torch.Tensor]], int], float],
    ) -> None:
        self.group, self.buckets, self.params = group, buckets, params
        self.version, self.device, self._apply = version, device, apply
        self.result: StreamResult | None = None
        self._done = threading.Event()
        self._side: torch.cuda.Stream | None = None  # the receive's CUDA stream (GPU only)
        self._thread = threading.Thread(target=self._run, name="weight-stream", daemon=True)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def start(self) -> StreamReceiver:
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> StreamResult | None:
        """The outcome, or None if the update is still being received after ``timeout`` s."""
        self._done.wait(timeout)
        return self.result

    def _run(self) -> None:
        try:
            # On a GPU the engine decodes on the default stream meanwhile: the broadcast's wait
            # and the checks go on a stream of their own (current streams are per thread).
            self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with self._on_side():
                self.result = self._receive()
        except Exception as e:  # noqa: BLE001 - whatever it is, nothing was applied; say so
            self.result = StreamResult(500, f"the streamed update failed: {type(e).__name__}: {e}")
        finally:
            self._done.set()

    def _on_side(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    def _check(
        self, spec: BucketSpec, flat: torch.Tensor
    ) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        with self._on_side():
            received = unpack_bucket(spec.names, spec.dtypes, spec.shapes, flat[: spec.nbytes])
            return checked_update(received, self.params)

    def _receive(self) -> StreamResult:
        t0 = time.perf_counter()
        timings = {"receive_s": 0.0, "check_wait_s": 0.0, "apply_s": 0.0}
        checks: list[Future[tuple[list[tuple[str, torch.Tensor]], list[str]]]] = []
        # One checker thread: bucket k is checked while bucket k+1 arrives.
        with ThreadPoolExecutor(1, thread_name_prefix="weight-check") as pool:
            for k, spec in enumerate(self.buckets):
                flat = torch.empty(spec.nbytes + TRAILER_BYTES, dtype=torch.uint8, device=self.device)
                tb = time.perf_counter()
                try:
                    broadcast(flat, self.group, src=0)
                except RuntimeError as e:  # the group broke (the trainer died): nothing applied
                    return StreamResult(
                        500, f"bucket {k}: the broadcast failed: {str(e)[:300]}; nothing was applied"
                    )
                timings["receive_s"] += time.perf_counter() - tb
                status = read_trailer(flat, spec.nbytes)
                if status != STREAM_CONTINUE:
                    return StreamResult(
                        400,
                        f"the trainer aborted the update at bucket {k} (trailer {status}); nothing was applied",
                    )
                checks.append(pool.submit(self._check, spec, flat))
            tw = time.perf_counter()
            tensors: list[tuple[str, torch.Tensor]] = []
            errors: list[str] = []
            for f in checks:
                ok, bad = f.result()
                tensors += ok
                errors += bad
            timings["check_wait_s"] = time.perf_counter() - tw
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return StreamResult(400, f"{errors[0]}{more}; nothing was applied", timings)
        if self._side is not None:
            self._side.synchronize()  # every byte written before the engine's stream reads it
            engine_stream = torch.cuda.default_stream(self.device)
            for _, t in tensors:  # allocated on the side stream, freed after the engine's use
                t.record_stream(engine_stream)
        timings["apply_s"] = self._apply(tensors, self.version)
        timings["total_s"] = time.perf_counter() - t0
        sent = ((n, getattr(torch, d)) for b in self.buckets for n, d in zip(b.names, b.dtypes))
        note = cast_note(dtype_casts(sent, self.params))
        return StreamResult(200, f"applied {len(tensors)} tensors as version {self.version}.{note}", timings)


def install(params: dict[str, torch.Tensor], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Make each checked tensor its parameter's storage (the caller holds the engine lock).

    A tensor that already has its parameter's dtype, device and shape *becomes* the parameter's
    data (no copy: it is a view into the received bucket); any other is copied in.
    """
    with torch.no_grad():
        for n, t in tensors:
            p = params[n]
            if t.dtype == p.dtype and t.device == p.device and t.shape == p.shape and t.is_contiguous():
                p.data = t
            else:
                p.copy_(t)
