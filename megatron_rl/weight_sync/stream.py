"""The trainer side of a streamed update: bucket k+1 is packed while bucket k is broadcast.

:class:`BucketPacker` runs the bucket iterator (the HF conversion, the casts and the copies into a
flat buffer) on a thread of its own and hands packed buckets to the caller, who broadcasts them.
Two flat buffers, reused from sync to sync, alternate: the packer fills one while the other is on
the wire, so packing costs the update only where it is slower than the broadcast (and for the
first bucket, which the manifest's round trip overlaps). The wire format, a bucket's bytes in
``protocol.pack_bucket``'s order followed by a status trailer, is in
``generation/engine/weights.py``.

The packer always runs the bucket iterator to its end, also after an error: on a multi-rank
trainer the iterator takes part in the gathers of the other ranks, which must not be left
waiting. What it yields after an error is not packed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_rl.generation.engine.weights import STREAM_CONTINUE, TRAILER_BYTES, BucketSpec, write_trailer
from megatron_rl.generation.protocol import bucket_layout, dtype_name

__all__ = ["BucketPacker", "LayoutChanged", "Packed", "bucket_spec", "pack_order"]


class LayoutChanged(RuntimeError):
    """The model's tensors no longer match the layout the update was announced with."""


def pack_order(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors in flattened-bucket order: larger element sizes first, model order
    within a size (what ``protocol.pack_bucket`` does, so both paths lay bytes out alike)."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def bucket_spec(bucket: list[tuple[str, torch.Tensor]]) -> BucketSpec:
    """Names, dtypes, shapes and byte size of a bucket, in :func:`pack_order`."""
    items = pack_order(bucket)
    dtypes = [dtype_name(t.dtype) for _, t in items]
    shapes = [list(t.shape) for _, t in items]
    _, nbytes = bucket_layout(dtypes, shapes)
    return BucketSpec(tuple(n for n, _ in items), tuple(dtypes), tuple(tuple(s) for s in shapes), nbytes)


@dataclass
class Packed:
    """Bucket ``index`` packed into ``flat`` (its bytes, then the trailer), ``tensors`` of them."""

    index: int
    flat: torch.Tensor
    tensors: int
    buffer: int  # which of the two buffers: handed back with BucketPacker.release


class BucketPacker:
    """Packs ``buckets`` (lists of named tensors, in the order and sizes of ``specs``) on a thread
    of its own into two reusable buffers; iterate to receive them, :meth:`release` each once its
    broadcast is done. ``on_bucket`` (optional) sees every bucket's tensors (digests)."""

    def __init__(
        self,
        buckets: Iterator[list[tuple[str, torch.Tensor]]],
        specs: list[BucketSpec],
        buffers: list[torch.Tensor],
        on_bucket: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    ) -> None:
        if len(buffers) != 2:
            raise ValueError(f"buffers: two are needed (double buffering), got {len(buffers)}")
        need = max(s.nbytes for s in specs) + TRAILER_BYTES
        if any(b.numel() < need for b in buffers):
            raise ValueError(f"buffers: each must hold {need} bytes")
        self._buckets, self.specs, self.buffers = buckets, specs, buffers
        self._on_bucket = on_bucket
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(2):
            self._free.put(i)
        self._ready: queue.Queue[Packed | BaseException | None] = queue.Queue()
        self._stop = threading.Event()
        self.pack_s = 0.0  # seconds spent packing (on the packer's thread)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-pack", daemon=True)

    def start(self) -> BucketPacker:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Pack nothing more (the iterator still runs to its end); wakes a waiting packer."""
        self._stop.set()

    def release(self, packed: Packed) -> None:
        """Hand ``packed``'s buffer back (its broadcast returned)."""
        self._free.put(packed.buffer)

    def join(self) -> None:
        """Wait for the packer's thread (after :meth:`stop`, or after the last bucket)."""
        self._thread.join()

    def __iter__(self) -> Iterator[Packed]:
        """The packed buckets in order; raises what went wrong on the packer's side."""
        while True:
            item = self._ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _take_buffer(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def _run(self) -> None:
        k = 0
        try:
            for bucket in self._buckets:
                if self._stop.is_set() or self.error is not None:
                    continue  # keep the other ranks' gathers in step; nothing more is packed
                try:
                    self._pack_one(k, bucket)
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    self.error = e
                    self._ready.put(e)
                k += 1
            if self.error is None and not self._stop.is_set() and k != len(self.specs):
                self.error = LayoutChanged(
                    f"the model yields {k} buckets, the update announced {len(self.specs)}"
                )
                self._ready.put(self.error)
        except BaseException as e:  # noqa: BLE001 - the iterator itself failed
            if self.error is None:
                self.error = e
                self._ready.put(e)
        finally:
            self._ready.put(None)

    def _pack_one(self, k: int, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if k >= len(self.specs):
            raise LayoutChanged(f"the model yields more than the {len(self.specs)} buckets announced")
        spec = self.specs[k]
        items = pack_order(bucket)
        got = bucket_spec(items)
        if got != spec:
            raise LayoutChanged(f"bucket {k} holds {list(got.names)[:3]}..., not what the update announced")
        if self._on_bucket is not None:
            self._on_bucket(items)
        i = self._take_buffer()
        if i is None:
            return
        t0 = time.perf_counter()
        buf = self.buffers[i]
        spans, _ = bucket_layout(spec.dtypes, spec.shapes)
        for (_, t), (a, b) in zip(items, spans):
            if b > a:
                buf[a:b].view(t.dtype).view(t.shape).copy_(t)
        write_trailer(buf, spec.nbytes, STREAM_CONTINUE)
        self.pack_s += time.perf_counter() - t0
        self._ready.put(Packed(k, buf[: spec.nbytes + TRAILER_BYTES], len(items), i))
