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

Tensors go in the model's dtype (``cast_dtype`` to change it, e.g. bf16 for a bf16 fleet).
Megatron keeps norms in fp32 inside a bf16 model; those go as fp32 unless cast.

A server that died leaves the update group unusable (a broadcast would wait for it):
:meth:`sync` notices a fleet whose live membership changed, tears the group down and builds a
new one, on the next port, with the servers still alive.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.generation.protocol import pack_bucket, tensor_digest, update_weights_payload
from megatron_rl.generation.update_group import broadcast, destroy_update_group, init_update_group

if TYPE_CHECKING:
    from megatron_rl.generation.client import FleetClient

__all__ = ["WeightBroadcaster", "WeightSyncConfig"]


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How rank 0 reaches the fleet."""

    backend: str = "auto"  # nccl, gloo, or auto: nccl with CUDA, else gloo
    master_address: str = "127.0.0.1"  # an address of trainer rank 0 the servers can reach
    # Rendezvous port of the update group on master_address; 0 (default): a free one, picked when
    # the group is built (two runs on one host never collide). A fixed port goes +1 per rebuild.
    master_port: int = 0
    group_name: str = "megatron_rl_weights"
    bucket_mb: float = 512.0  # bytes per broadcast
    cast_dtype: str | None = None  # e.g. "bfloat16"; None: the parameters' dtype
    pause_mode: str = "in_place"  # in_place keeps the KV cache; abort ends running requests
    timeout_s: float = 300.0
    verify: bool = False  # after each sync, check the servers' weight digests (built-in engine)

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, ("auto", "nccl", "gloo"))
        if self.backend == "auto":
            self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        check_choice("pause_mode", self.pause_mode, ("in_place", "abort"))
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
        self._port = cfg.master_port

    @property
    def fleet(self) -> FleetClient:
        """The fleet client (rank 0 only: the other ranks never reach the servers)."""
        if self._fleet is None:
            raise RuntimeError(f"WeightBroadcaster: rank {self.rank} has no fleet client (rank 0 has)")
        return self._fleet

    def _rendezvous_port(self) -> int:
        """The port of a new group: a free one on master_address when the recipe leaves it at 0;
        else the recipe's, then the next after the last (the old store may still hold it)."""
        if self.cfg.master_port == 0:
            with socket.socket() as sock:
                sock.bind((self.cfg.master_address, 0))
                return int(sock.getsockname()[1])
        return self.cfg.master_port if self.group is None and not self._members else self._port + 1

    # ------------------------------------------------------------------ group

    def connect(self) -> None:
        """Build the update group with every live server (rank 0 only; other ranks no-op)."""
        if self.rank != 0:
            return
        self._port = self._rendezvous_port()
        self.fleet.refresh()
        self.fleet.update_urls = self.fleet.live_update_urls()
        if not self.fleet.update_urls:
            raise RuntimeError("weight sync: no live server to update")
        futs = self.fleet.init_update_group_async(
            master_address=self.cfg.master_address,
            master_port=self._port,
            group_name=self.cfg.group_name,
            backend=self.cfg.backend,
        )
        self.group = init_update_group(
            backend=self.cfg.backend,
            master_address=self.cfg.master_address,
            master_port=self._port,
            rank=0,
            world_size=self.fleet.update_world_size(),
            group_name=self.cfg.group_name,
            timeout_s=self.cfg.timeout_s,
        )
        for f in futs:
            f.result()
        self._members = tuple(self.fleet.update_urls)

    def close(self) -> None:
        """Leave the update group (servers still alive are asked to leave it too)."""
        if self.group is not None:
            self.fleet.destroy_update_group(self.cfg.group_name)
            destroy_update_group(self.group)
            self.group = None

    def _rebuild_if_membership_changed(self) -> None:
        live = set(self.fleet.live_update_urls())
        if self.group is not None and all(u in live for u in self._members):
            return
        self.close()
        self.connect()

    # ------------------------------------------------------------------ sync

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        limit = int(self.cfg.bucket_mb * 2**20)
        cast = getattr(torch, self.cfg.cast_dtype) if self.cfg.cast_dtype else None
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in self.named_tensors():
            if self.rank != 0:
                continue
            t = t.detach().to("cpu" if self.cfg.backend == "gloo" else t.device)
            if cast is not None and t.is_floating_point():
                t = t.to(cast)
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t.contiguous()))
            size += nbytes
        if bucket:
            yield bucket

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
        servers still alive and the update is sent again, once.
        """
        t0 = time.perf_counter()
        if self.rank == 0:
            self.fleet.refresh()
            self._rebuild_if_membership_changed()
            self.fleet.pause(self.cfg.pause_mode)
            self.fleet.begin_update()
        t_paused = time.perf_counter()
        nbytes, n_buckets, n_tensors = 0, 0, 0
        failure: BaseException | None = None
        digests: dict[str, str] = {}
        try:
            for bucket in self._buckets():
                if failure is not None:
                    continue  # keep the collective gather in step; nothing more is sent
                if self.cfg.verify:
                    digests.update((n, tensor_digest(t)) for n, t in bucket)
                names, dtypes, shapes, flat = pack_bucket(bucket)
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
                    broadcast(flat, group, src=0)
                    for f in futs:
                        f.result()
                except Exception as e:  # noqa: BLE001 - a server died mid-update
                    failure = e
                    continue
                nbytes += flat.numel()
                n_buckets += 1
                n_tensors += len(names)
        finally:
            if self.rank == 0:
                for call in (self.fleet.end_update, self.fleet.resume):
                    try:
                        call()
                    except Exception as e:  # noqa: BLE001
                        failure = failure or e
        if self._agree(failure is not None):
            if not _retry:
                raise RuntimeError(f"weight sync failed twice: {failure}") from failure
            if self.rank == 0:
                self.fleet.refresh()
                self.close()
                self.connect()
            return self.sync(version, _retry=False)
        seconds = time.perf_counter() - t0
        stats = {
            "weight_sync/seconds": seconds,
            "weight_sync/pause_s": t_paused - t0,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/buckets": float(n_buckets),
            "weight_sync/tensors": float(n_tensors),
            "weight_sync/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
            "weight_sync/version": float(version),
        }
        if self.rank == 0 and self.cfg.verify:
            stats["weight_sync/verified"] = float(self.verify(digests))
        return stats

    def verify(self, digests: dict[str, str]) -> bool:
        """Compare the servers' ``/megatron_rl/weights_digest`` (built-in engine only) with the
        digests of what was sent; raises naming the first server and tensor that differ."""
        for url in self.fleet.update_urls:
            theirs = self.fleet.weights_digest(url)
            bad = [n for n, d in digests.items() if theirs.get(n) != d]
            if bad:
                raise RuntimeError(f"weight sync: {url} holds different {bad[0]} ({len(bad)} tensors differ)")
        return True


def _sync_group() -> dist.ProcessGroup | None:
    """The ranks that call :meth:`WeightBroadcaster.sync` together (model-parallel ranks of the
    first data-parallel replica), or None for a single rank."""
    try:
        from megatron.core import (
            parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        if ps.model_parallel_is_initialized():
            g = ps.get_model_parallel_group()
            return g if dist.get_world_size(g) > 1 else None
    except ImportError:
        pass
    return None
