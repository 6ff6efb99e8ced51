"""The trainer side of the weight update: HF-named tensors, bucketed, broadcast to the fleet.

    sync = WeightBroadcaster(trainer.hf_tensors, fleet, WeightSyncConfig(backend="gloo"))
    sync.connect()                        # every server joins the update group (rank 0: us)
    stats = sync.sync(version=step)       # pause in place -> buckets -> continue

Collective over the trainer's ranks: every rank calls :meth:`connect` and :meth:`sync`. Each
pipeline stage turns its chunks into full HF tensors and stages after the first stream theirs to
global rank 0 (the trainer's ``hf_tensors``, :func:`megatron_rl.training.chunks.iter_model_hf`),
one tensor at a time, so rank 0 never holds more than one bucket. Rank 0
alone talks to the servers and owns the update group (``generation/update_group.py``).

One update, as Magistral does it: ``/pause_generation`` (``in_place``: running sequences keep
their KV cache), ``/begin_weight_update``, then per bucket ``/update_weights_from_distributed``
(``flush_cache: false``, ``weight_version``, ``flattened_bucket``) posted to every server while
rank 0 broadcasts the bucket's bytes, ``/end_weight_update``, ``/continue_generation``. Tokens
sampled after it carry the new version; tokens before it keep the old one.

**Streamed** (``stream``: ``auto`` picks it when every update target is a built-in engine, which
says so in ``/server_info``; SGLang servers keep the per-bucket protocol): one
``/megatron_rl/update_weights_stream`` carries the whole update's manifest, and every server
checks it before a byte is sent (a refusal costs a round trip, never a broadcast left waiting).
The fleet is not paused (``pause_mode: auto`` = ``none`` here): a server receives on a thread of
its own (on a GPU, its own CUDA stream) while its engine decodes with the old weights, and swaps
the new ones in between two engine steps once every bucket arrived and passed its checks -- the
generators never wait for the transfer, only for the swap (the received tensors become the
parameters: no copy). ``in_place`` or ``abort`` pause it anyway, as the per-bucket path must.
The buckets follow the manifest as broadcasts alone, no HTTP per bucket, with bucket k+1 packed
on a thread of its own while bucket k is on the wire (``weight_sync/stream.py``, two reused
buffers); ``/end_weight_update`` answers once the servers applied the update, whole
or not at all (``generation/engine/weights.py``). The manifest needs the buckets' names and
shapes up front: the first streamed sync reads them in one extra pass over the tensors. A
broadcast that fails drops our end of the group at once, so the other servers' receives fail
then too instead of at the group's timeout. ``sync``'s stats split the time into
``pack_s`` (overlapped), ``pack_wait_s`` (not), ``broadcast_s``, ``apply_s`` (the servers') and
``control_s`` (HTTP round trips).

Tensors go in the model's dtype (``cast_dtype`` to change it, e.g. bf16 for a bf16 fleet).
Megatron keeps norms in fp32 inside a bf16 model; those go as fp32 unless cast.

A server that died leaves the update group unusable (a broadcast would wait for it):
:meth:`sync` notices a fleet whose live membership changed, tears the group down and builds a
new one, on the next port, with the servers still alive.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.errors import UsageError
from megatron_rl.generation.engine.weights import (
    ENGINE_CAPABILITY,
    STREAM_ABORT,
    TRAILER_BYTES,
    BucketSpec,
    stream_payload,
    write_trailer,
)
from megatron_rl.generation.protocol import fused_partner, pack_bucket, tensor_digest, update_weights_payload
from megatron_rl.generation.update_group import broadcast, destroy_update_group, init_update_group, listen
from megatron_rl.weight_sync.stream import BucketPacker, LayoutChanged, bucket_spec

if TYPE_CHECKING:
    from megatron_rl.generation.client import FleetClient

__all__ = ["WeightBroadcaster", "WeightSyncConfig", "bucket_tensors", "checksums_agree"]

log = logging.getLogger("megatron_rl.weight_sync")


def bucket_tensors(
    named: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` in buckets of at most ``limit`` bytes (a larger tensor gets one of its own), in
    order; a bucket never ends between a tensor and the partner SGLang's loader fuses it with
    (:func:`~megatron_rl.generation.protocol.fused_partner`: DeepSeek's ``q_a_proj`` and
    ``kv_a_proj_with_mqa``), which may then exceed ``limit`` by the tensors between them."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    waiting_for: str | None = None  # the partner this bucket must still take
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit and waiting_for is None:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
        if name == waiting_for:
            waiting_for = None
        waiting_for = fused_partner(name) or waiting_for
    if bucket:
        yield bucket


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How rank 0 reaches the fleet."""

    backend: str = "auto"  # nccl, gloo, or auto: nccl with CUDA, else gloo
    master_address: str = "127.0.0.1"  # an address of trainer rank 0 the servers can reach
    # Rendezvous port of the update group on master_address; 0 (default): a free one, picked when
    # the group is built (two runs on one host never collide). A fixed port goes +1 per rebuild.
    master_port: int = 0
    group_name: str = "megatron_rl_weights"  # the update group's name, as SGLang's update routes take it
    bucket_mb: float = 512.0  # bytes per broadcast
    cast_dtype: str | None = None  # e.g. "bfloat16"; None: the parameters' dtype
    # What the fleet does during an update. in_place: paused, running requests keep their KV
    # cache; abort: running requests end (and are re-sent); none: the servers decode while they
    # receive and swap the weights in between two engine steps (streamed updates only: the
    # built-in engine receives on a thread of its own); auto: none when streamed, else in_place.
    pause_mode: str = "auto"
    timeout_s: float = 300.0  # the update group's collective timeout (a server that stops answering)
    # After each sync, check what the servers hold: the built-in engine's per-tensor digests must
    # equal what was sent; SGLang's own /weights_checker checksums must agree across its servers
    # of one layout (its tensors are in SGLang's fused, sharded layout, not ours).
    verify: bool = False
    # The servers' prefix (radix) cache after an update holds KV of the old weights. keep: leave
    # it (the loop logs the cached share of prompt tokens, generator/prefix_cached_fraction);
    # flush: /flush_cache after every update (SGLang flushes only an idle server: sync loops).
    prefix_cache: str = "keep"
    # on: one manifest per update, buckets packed while the previous is broadcast (built-in
    # engines only); off: SGLang's one /update_weights_from_distributed per bucket; auto: on when
    # every update target says it takes streamed updates (the built-in engine), else off.
    stream: str = "auto"

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("stream", self.stream, ("auto", "on", "off"))
        check_choice("prefix_cache", self.prefix_cache, ("keep", "flush"))
        if self.backend == "auto":
            self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        check_choice("pause_mode", self.pause_mode, ("auto", "none", "in_place", "abort"))
        if self.pause_mode == "none" and self.stream == "off":
            raise ConfigFieldError(
                "pause_mode",
                "none needs streamed updates (stream: auto or on): a per-bucket update is received "
                "by the server's scheduler itself, which cannot decode meanwhile",
            )
        check_range("bucket_mb", self.bucket_mb, low=0.0, low_open=True)
        check_range("master_port", self.master_port, low=0, high=65535)
        if self.cast_dtype is not None and not isinstance(getattr(torch, self.cast_dtype, None), torch.dtype):
            raise ConfigFieldError("cast_dtype", f"not a torch dtype: {self.cast_dtype!r}")


class WeightBroadcaster:
    """Bucketed broadcast of the trainer's weights to the fleet; see the module docstring."""

    def __init__(
        self,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        fleet: FleetClient | None,
        cfg: WeightSyncConfig,
    ) -> None:
        # Called once per sync on every rank that takes part: yields the whole model's HF-named
        # tensors on rank 0 (and takes part in the gathers elsewhere), e.g. PolicyTrainer.hf_tensors.
        self.named_tensors = named_tensors
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.rank == 0 and fleet is None:
            raise ValueError("WeightBroadcaster: rank 0 talks to the fleet and needs its client")
        self._fleet = fleet  # rank 0's client; other ranks take part in the gathers only
        self.cfg = cfg
        self.group: dist.ProcessGroup | None = None  # the update group (rank 0, once connected)
        self._members: tuple[str, ...] = ()
        self._built_at = 0.0  # time.monotonic() when connect() built the current group
        self._port = cfg.master_port
        self.streaming = False  # rank 0: whether this group's updates are streamed (connect)
        self._specs: list[BucketSpec] | None = None  # the model's bucket layout, once read
        self._buffers: list[torch.Tensor] = []  # the packer's two flat buffers, kept between syncs
        self._broken = False  # our end of the group was dropped after a failed broadcast

    @property
    def fleet(self) -> FleetClient:
        """The fleet client (rank 0 only: the other ranks never reach the servers)."""
        if self._fleet is None:
            raise RuntimeError(f"WeightBroadcaster: rank {self.rank} has no fleet client (rank 0 has)")
        return self._fleet

    def _rendezvous_port(self) -> int:
        """The port to bind for a new group: 0 (the system picks a free one, bound before the
        servers are told it) when the recipe leaves it at 0; else the recipe's, then the next
        after the last (the old store may still hold it)."""
        if self.cfg.master_port == 0:
            return 0
        return self.cfg.master_port if self.group is None and not self._members else self._port + 1

    # ------------------------------------------------------------------ group

    def connect(self) -> None:
        """Build the update group with every live server (rank 0 only; other ranks no-op)."""
        if self.rank != 0:
            return
        self.fleet.refresh()
        self.fleet.update_urls = self.fleet.live_update_urls()
        if not self.fleet.update_urls:
            raise RuntimeError("weight sync: no live server to update")
        self._built_at = time.monotonic()  # servers held before this are in the group built here
        # Listen first, then tell the servers the port: nothing else can take it in between.
        fd, self._port = listen(self.cfg.master_address, self._rendezvous_port())
        try:
            futs = self.fleet.init_update_group_async(
                master_address=self.cfg.master_address,
                master_port=self._port,
                group_name=self.cfg.group_name,
                backend=self.cfg.backend,
            )
        except BaseException:
            os.close(fd)  # not handed to a store yet: ours to close
            raise
        # From here the store owns the descriptor (and closes it), whether or not it comes up.
        try:
            self.group = init_update_group(
                backend=self.cfg.backend,
                master_address=self.cfg.master_address,
                master_port=self._port,
                rank=0,
                world_size=self.fleet.update_world_size(),
                group_name=self.cfg.group_name,
                timeout_s=self.cfg.timeout_s,
                listen_fd=fd,
            )
        except RuntimeError as e:
            # torch says only how many ranks joined; a server that refused to join (a master
            # address it cannot reach, say) has answered why by now: that is the message.
            refused = [f.exception() for f in futs if f.done() and f.exception() is not None]
            if refused:
                raise RuntimeError(f"weight sync: the update group did not form: {refused[0]}") from e
            raise
        for f in futs:
            f.result()
        self._members = tuple(self.fleet.update_urls)
        if self.cfg.stream == "off":
            self.streaming = False
        else:
            self.streaming = self.fleet.takes_streamed_updates()
            if self.cfg.stream == "on" and not self.streaming:
                raise UsageError(
                    "weight_sync.stream: on, but not every update target takes streamed updates "
                    "(only the built-in engine does; use auto or off for SGLang servers)"
                )
        if self.cfg.pause_mode == "none" and not self.streaming:
            raise UsageError(
                "weight_sync.pause_mode: none, but not every update target takes streamed updates "
                "(only the built-in engine does; use auto or in_place for SGLang servers)"
            )

    def pause_mode(self, streaming: bool) -> str:
        """The pause an update makes: the recipe's, ``auto`` resolved (none when streamed)."""
        if self.cfg.pause_mode == "auto":
            return "none" if streaming else "in_place"
        return self.cfg.pause_mode

    def close(self) -> None:
        """Leave the update group (servers still alive are asked to leave it too)."""
        if self.group is not None or self._broken:
            self.fleet.destroy_update_group(self.cfg.group_name)
            if self.group is not None:
                destroy_update_group(self.group)
            self.group = None
            self._broken = False

    def _rebuild_if_membership_changed(self) -> None:
        live = set(self.fleet.live_update_urls())
        restarted = [  # held since the group was built: a new process, not in the group
            s
            for s in self.fleet.servers
            if s.held and s.url in self._members and s.held_since > self._built_at
        ]
        if self.group is not None and live == set(self._members) and not restarted:  # none gone, none back
            return
        self.close()
        self.connect()

    # ------------------------------------------------------------------ sync

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        cast = getattr(torch, self.cfg.cast_dtype) if self.cfg.cast_dtype else None

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in self.named_tensors():
                if self.rank != 0:
                    continue  # the other ranks take part in the gathers only
                t = t.detach().to("cpu" if self.cfg.backend == "gloo" else t.device)
                if cast is not None and t.is_floating_point():
                    t = t.to(cast)
                yield name, t.contiguous()

        return bucket_tensors(tensors(), int(self.cfg.bucket_mb * 2**20))

    def _agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank that takes part in the sync."""
        group = _sync_group()
        if group is None:
            return flag
        t = torch.tensor([int(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        return bool(t.item())

    def sync(self, version: int, *, _retry: bool = True) -> dict[str, float]:
        """Send the current weights as policy ``version``; returns timings (on rank 0).

        If a server dies during the update (its broadcast fails), the group is rebuilt with the
        servers still alive and the update is sent again, once. With no server to update at all,
        nothing is sent (``weight_sync/skipped``).
        """
        t0 = time.perf_counter()
        times = {"control_s": 0.0, "pack_s": 0.0, "pack_wait_s": 0.0, "broadcast_s": 0.0, "apply_s": 0.0}
        nobody = False  # no server to update: all dead, the fleet doctor restarting them
        if self.rank == 0:
            self.fleet.refresh()
            nobody = not self.fleet.live_update_urls()
            if nobody:
                self.close()  # its members are gone; a server back later joins a new group
            else:
                self._rebuild_if_membership_changed()
        if self._agree(nobody):  # they get this version when they are back (fleet_health.py)
            return {"weight_sync/skipped": 1.0, "weight_sync/version": float(version)}
        streaming = self._agree(self.streaming)
        if streaming and self._agree(self._specs is None):
            self._read_layout()
        times["control_s"] += time.perf_counter() - t0
        digests: dict[str, str] = {}
        send = self._send_stream if streaming else self._send_buckets
        nbytes, n_buckets, n_tensors, failure = send(version, digests, times)
        if self._agree(failure is not None):
            if not _retry:
                raise RuntimeError(f"weight sync failed twice: {failure}") from failure
            if self.rank == 0:
                self.fleet.refresh()
                self.close()
                self.connect()
            self._specs = None if isinstance(failure, LayoutChanged) else self._specs
            return self.sync(version, _retry=False)
        seconds = time.perf_counter() - t0
        stats = {
            "weight_sync/seconds": seconds,
            "weight_sync/pause_s": times.pop("pause_s", 0.0),
            "weight_sync/bytes": float(nbytes),
            "weight_sync/buckets": float(n_buckets),
            "weight_sync/tensors": float(n_tensors),
            "weight_sync/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
            "weight_sync/version": float(version),
            "weight_sync/streamed": float(streaming),
            **{f"weight_sync/{k}": v for k, v in times.items()},
        }
        if self.rank == 0 and self.cfg.verify:
            stats["weight_sync/verified"] = float(self.verify(digests))
        if self.rank == 0:  # servers back from a death that joined this group hold this version now
            self.fleet.admit(set(self.fleet.held_urls()) & set(self._members), held_before=self._built_at)
        return stats

    def _read_layout(self) -> None:
        """Every rank: one pass over the model's tensors for the buckets' names, dtypes and shapes
        (what a streamed update announces up front); rank 0 keeps them and sizes its buffers."""
        specs = [bucket_spec(b) for b in self._buckets()]
        if self.rank != 0:
            return
        if not specs:
            raise RuntimeError("weight sync: the model yields no tensors to send")
        self._specs = specs
        need = max(s.nbytes for s in specs) + TRAILER_BYTES
        if not self._buffers or self._buffers[0].numel() < need:
            device = "cpu" if self.cfg.backend == "gloo" else "cuda"
            self._buffers = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)]

    def _send_buckets(
        self, version: int, digests: dict[str, str], times: dict[str, float]
    ) -> tuple[int, int, int, BaseException | None]:
        """SGLang's protocol: pause, begin, one ``/update_weights_from_distributed`` per bucket
        with its broadcast, end, continue. Returns bytes, buckets, tensors sent and the failure."""
        tc = time.perf_counter()
        pause = self.pause_mode(streaming=False)
        if self.rank == 0:
            self.fleet.pause(pause)
            self.fleet.begin_update()
        times["pause_s"] = time.perf_counter() - tc
        times["control_s"] += times["pause_s"]
        nbytes, n_buckets, n_tensors = 0, 0, 0
        failure: BaseException | None = None
        try:
            for bucket in self._buckets():
                if failure is not None:
                    continue  # keep the collective gather in step; nothing more is sent
                if self.cfg.verify:
                    digests.update((n, tensor_digest(t)) for n, t in bucket)
                tp = time.perf_counter()
                names, dtypes, shapes, flat = pack_bucket(bucket)
                times["pack_s"] += time.perf_counter() - tp
                group = self.group
                if group is None:  # buckets exist on rank 0 only, which connected above
                    raise RuntimeError("weight sync: rank 0 holds no update group (connect() first)")
                futs = self.fleet.update_weights_async(
                    update_weights_payload(
                        names=names,
                        dtypes=dtypes,
                        shapes=shapes,
                        group_name=self.cfg.group_name,
                        weight_version=version,
                    )
                )
                try:
                    tb = time.perf_counter()
                    broadcast(flat, group, src=0)
                    times["broadcast_s"] += time.perf_counter() - tb
                    tw = time.perf_counter()
                    for f in futs:
                        f.result()
                    times["apply_s"] += time.perf_counter() - tw  # the servers' check and copy
                except Exception as e:  # noqa: BLE001 - a server died mid-update
                    failure = e
                    continue
                nbytes += flat.numel()
                n_buckets += 1
                n_tensors += len(names)
        finally:
            if self.rank == 0:
                failure = self._finish(failure, times, paused=True)
        return nbytes, n_buckets, n_tensors, failure

    def _finish(
        self, failure: BaseException | None, times: dict[str, float], *, paused: bool
    ) -> BaseException | None:
        """End the update on every server and let them continue if they were paused; the first
        failure, if any. A streamed update's outcome and the servers' apply time come back from
        ``end``."""
        tc = time.perf_counter()
        apply_s = 0.0
        try:
            for answer in self.fleet.end_update():
                stream = answer.get("stream") if isinstance(answer, dict) else None
                if isinstance(stream, dict):  # the server's wait for its last checks, and the swap
                    server_s = sum(float(stream.get(k, 0.0)) for k in ("check_wait_s", "apply_s"))
                    apply_s = max(apply_s, server_s)
        except Exception as e:  # noqa: BLE001
            failure = failure or e
        if self.cfg.prefix_cache == "flush" and failure is None:
            refused = self.fleet.flush_cache()
            times["flush_refused"] = float(len(refused))
            if refused:
                log.warning(
                    "prefix cache not flushed on %s: requests were running or waiting", ", ".join(refused)
                )
        try:
            if paused:
                self.fleet.resume()
        except Exception as e:  # noqa: BLE001
            failure = failure or e
        times["apply_s"] += apply_s
        times["control_s"] += time.perf_counter() - tc - apply_s
        return failure

    def _send_stream(
        self, version: int, digests: dict[str, str], times: dict[str, float]
    ) -> tuple[int, int, int, BaseException | None]:
        """The built-in engine's streamed update: the manifest once (its round trip, and the
        pause's, overlap packing the first bucket), then the buckets back to back, bucket k+1
        packed while bucket k is broadcast; the servers apply it whole at ``end``."""
        if self.rank != 0:
            for _ in self._buckets():  # take part in the gathers; rank 0 sends
                pass
            return 0, 0, 0, None
        specs, group = self._specs, self.group
        if specs is None or group is None:
            raise RuntimeError("weight sync: rank 0 holds no update group or layout (connect() first)")
        on_bucket = (
            (lambda b: digests.update((n, tensor_digest(t)) for n, t in b)) if self.cfg.verify else None
        )
        packer = BucketPacker(self._buckets(), specs, self._buffers, on_bucket).start()
        nbytes, n_buckets, n_tensors = 0, 0, 0
        failure: BaseException | None = None
        tc = time.perf_counter()
        pause = self.pause_mode(streaming=True)
        try:
            # The pause (if any) and the manifest travel together (the built-in engine applies the
            # update between two steps whenever it lands); both round trips overlap the first pack.
            payload = stream_payload(group_name=self.cfg.group_name, weight_version=version, buckets=specs)
            futs = self.fleet.pause_async(pause) if pause != "none" else []
            futs += self.fleet.update_weights_stream_async(payload)
            for f in futs:
                f.result()  # ready: the manifest passed every server's checks
        except Exception as e:  # noqa: BLE001 - refused (400 naming the field) or a server gone
            failure = e
            packer.stop()
        times["pause_s"] = time.perf_counter() - tc
        times["control_s"] += times["pause_s"]
        it = iter(packer)
        try:
            while True:
                tw = time.perf_counter()
                try:
                    packed = next(it)
                except StopIteration:
                    break
                times["pack_wait_s"] += time.perf_counter() - tw
                if failure is None:
                    tb = time.perf_counter()
                    try:
                        broadcast(packed.flat, group, src=0)
                    except Exception as e:  # noqa: BLE001 - a server died mid-update
                        failure = e
                        packer.stop()
                        self._drop_broken_group()
                    times["broadcast_s"] += time.perf_counter() - tb
                    if failure is None:
                        nbytes += packed.flat.numel() - TRAILER_BYTES
                        n_buckets += 1
                        n_tensors += packed.tensors
                packer.release(packed)
        except Exception as e:  # noqa: BLE001 - the packer failed: tell the servers, stop
            if failure is None:
                failure = e
                if n_buckets < len(specs):  # else every announced bucket went: nothing to stop
                    self._abort_stream(specs[n_buckets], group)
        finally:
            packer.stop()
            packer.join()
            times["pack_s"] += packer.pack_s
            del group
            failure = self._finish(failure, times, paused=pause != "none")
        return nbytes, n_buckets, n_tensors, failure

    def _abort_stream(self, spec: BucketSpec, group: dist.ProcessGroup) -> None:
        """Send bucket-sized bytes with the abort trailer: the servers stop and apply nothing."""
        flat = self._buffers[0][: spec.nbytes + TRAILER_BYTES]
        write_trailer(flat, spec.nbytes, STREAM_ABORT)
        try:
            broadcast(flat, group, src=0)
        except Exception:  # noqa: BLE001 - the group is gone too: the servers' receive fails
            self._drop_broken_group()

    def _drop_broken_group(self) -> None:
        """Tear down our end of a group whose broadcast failed, at once: the surviving servers'
        receives then fail now (their peer closed) instead of at the group's timeout."""
        if self.group is not None:
            destroy_update_group(self.group)
            self.group = None
            self._broken = True

    def verify(self, digests: dict[str, str]) -> bool:
        """Check what every update target holds after a sync; raises naming the server (and
        tensor or worker) that differs.

        A built-in engine (it advertises its ``/megatron_rl/`` routes) reports a digest per
        tensor: each must equal the digest of what was sent. An SGLang server holds its own fused,
        TP-sharded tensors, so its ``/weights_checker`` checksums cannot be compared with ours;
        instead every SGLang server of the same layout must report the same checksum per worker
        (a server that missed or mangled the update stands out)."""
        checksums: dict[str, dict[tuple[int, int], str]] = {}
        for url in self.fleet.update_urls:
            if self.fleet.server_info(url).get(ENGINE_CAPABILITY) is None:
                checksums[url] = self.fleet.weights_checksums(url)
                continue
            theirs = self.fleet.weights_digest(url)
            bad = [n for n, d in digests.items() if theirs.get(n) != d]
            if bad:
                raise RuntimeError(f"weight sync: {url} holds different {bad[0]} ({len(bad)} tensors differ)")
        checksums_agree(checksums)
        return True


def _sync_group() -> dist.ProcessGroup | None:
    """The ranks that call :meth:`WeightBroadcaster.sync` together (model-parallel ranks of the
    first data-parallel replica), or None for a single rank."""
    try:
        from megatron.core import (
            parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        if ps.model_parallel_is_initialized():
            # TP x EP x PP: the model-parallel group without EP; with it, also the EP peers
            # that take part in the expert gathers.
            g = ps.get_expert_tensor_model_pipeline_parallel_group()
            return g if dist.get_world_size(g) > 1 else None
    except ImportError:
        pass
    return None


def checksums_agree(checksums: dict[str, dict[tuple[int, int], str]]) -> None:
    """Raise, naming the server and worker, unless every server of one layout (the same set of
    ``(pp_rank, tp_rank)`` workers) reports the same ``/weights_checker`` checksum per worker as
    the first server of that layout."""
    first: dict[frozenset[tuple[int, int]], tuple[str, dict[tuple[int, int], str]]] = {}
    for url, sums in checksums.items():
        ref_url, ref = first.setdefault(frozenset(sums), (url, sums))
        bad = sorted(k for k in sums if sums[k] != ref[k])
        if bad:
            pp, tp = bad[0]
            raise RuntimeError(
                f"weight sync: {url} (pp_rank {pp}, tp_rank {tp}) holds different weights from "
                f"{ref_url}: /weights_checker checksums differ on {len(bad)} worker(s)"
            )
