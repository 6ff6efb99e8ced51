"""The trainer side of the weight update: HF-named tensors, bucketed, broadcast to the fleet.

    sync = WeightBroadcaster(trainer.chunks, hf_config, fleet, WeightSyncConfig(backend="gloo"))
    sync.connect()                        # every server joins the update group (rank 0: us)
    stats = sync.sync(version=step)       # pause in place -> buckets -> continue

Collective over the trainer's ranks: every rank calls :meth:`connect` and :meth:`sync`. Each
pipeline stage turns its chunks into full HF tensors (:func:`~.chunks.chunk_to_hf`, all-gathering
TP shards inside the stage); stages after the first send theirs to global rank 0 over the
trainer's default group, one tensor at a time, so rank 0 never holds more than one bucket. Rank 0
alone talks to the servers and owns the update group (``weight_sync/group.py``).

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

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_rl.config_checks import ConfigFieldError, check_choice, check_range
from megatron_rl.weight_sync.chunks import chunk_to_hf
from megatron_rl.weight_sync.hf_map import HFConverter

__all__ = ["WeightSyncConfig", "WeightBroadcaster", "iter_model_hf", "tensor_digest"]


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How rank 0 reaches the fleet."""

    backend: str = "auto"  # nccl, gloo, or auto: nccl with CUDA, else gloo
    master_address: str = "127.0.0.1"  # an address of trainer rank 0 the servers can reach
    master_port: int = 29650  # rendezvous port of the update group (+1 per rebuild)
    group_name: str = "megatron_rl_weights"
    bucket_mb: float = 512.0  # bytes per broadcast
    cast_dtype: str | None = None  # e.g. "bfloat16"; None: the parameters' dtype
    pause_mode: str = "in_place"  # in_place keeps the KV cache; abort ends running requests
    timeout_s: float = 300.0
    verify: bool = False  # after each sync, check the servers' weight digests (built-in engine)

    def __post_init__(self):
        check_choice("backend", self.backend, ("auto", "nccl", "gloo"))
        if self.backend == "auto":
            self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        check_choice("pause_mode", self.pause_mode, ("in_place", "abort"))
        check_range("bucket_mb", self.bucket_mb, low=0.0, low_open=True)
        check_range("master_port", self.master_port, low=1, high=65535)
        if self.cast_dtype is not None and not isinstance(getattr(torch, self.cast_dtype, None),
                                                          torch.dtype):
            raise ConfigFieldError("cast_dtype", f"not a torch dtype: {self.cast_dtype!r}")


def _pp_info() -> tuple[int, int, Any, Any]:
    """(pp rank, pp size, tp group or None, pp group) of this rank; TP=PP=1 without Megatron."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            tp = ps.get_tensor_model_parallel_group()
            return (ps.get_pipeline_model_parallel_rank(),
                    ps.get_pipeline_model_parallel_world_size(),
                    tp if dist.get_world_size(tp) > 1 else None,
                    ps.get_pipeline_model_parallel_group())
    except ImportError:
        pass
    return 0, 1, None, None


def iter_model_hf(chunks: list, converter: HFConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model, on global rank 0 of the first data-parallel replica,
    in model order (stage by stage). Collective over the model-parallel ranks of that replica;
    other ranks get nothing. Ranks of other data-parallel replicas must not call it."""
    pp_rank, pp_size, tp_group, pp_group = _pp_info()
    me = dist.get_rank() if dist.is_initialized() else 0
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    for stage in range(pp_size):
        src = 0 if pp_group is None else dist.get_global_rank(pp_group, stage)
        if stage == pp_rank:
            for chunk in chunks:
                for name, t in chunk_to_hf(chunk, converter, tp_group=tp_group):
                    if stage == 0:
                        if me == 0:
                            yield name, t
                    elif tp_rank == 0:
                        # stage leader -> rank 0: metadata, then the bytes
                        dist.send_object_list([name, list(t.shape), t.dtype], dst=0)
                        dist.send(t.contiguous(), dst=0)
            if stage > 0 and tp_rank == 0:
                dist.send_object_list([None, None, None], dst=0)
        elif me == 0:
            while True:
                meta = [None, None, None]
                dist.recv_object_list(meta, src=src)
                if meta[0] is None:
                    break
                t = torch.empty(meta[1], dtype=meta[2])
                dist.recv(t, src=src)
                yield meta[0], t


class WeightBroadcaster:
    """Bucketed broadcast of the trainer's weights to the fleet; see the module docstring."""

    def __init__(self, chunks: list, hf_config: Any, fleet: Any, cfg: WeightSyncConfig, *,
                 padded_vocab: int | None = None, tensor_parallel: int = 1):
        self.chunks = chunks
        self.converter = HFConverter.for_config(hf_config, tensor_parallel=tensor_parallel,
                                                padded_vocab=padded_vocab)
        self.fleet = fleet
        self.cfg = cfg
        self.group = None
        self._members: tuple[str, ...] = ()
        self._port = cfg.master_port
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.history: list[dict] = []

    # ------------------------------------------------------------------ group

    def connect(self) -> None:
        """Build the update group with every live server (rank 0 only; other ranks no-op)."""
        if self.rank != 0:
            return
        from megatron_rl.weight_sync.group import init_update_group

        self.fleet.refresh()
        self.fleet.update_urls = self.fleet.live_update_urls()
        if not self.fleet.update_urls:
            raise RuntimeError("weight sync: no live server to update")
        futs = self.fleet.init_update_group_async(
            master_address=self.cfg.master_address, master_port=self._port,
            group_name=self.cfg.group_name, backend=self.cfg.backend)
        self.group = init_update_group(
            backend=self.cfg.backend, master_address=self.cfg.master_address,
            master_port=self._port, rank=0, world_size=self.fleet.update_world_size(),
            group_name=self.cfg.group_name, timeout_s=self.cfg.timeout_s)
        for f in futs:
            f.result()
        self._members = tuple(self.fleet.update_urls)

    def close(self) -> None:
        """Leave the update group (servers still alive are asked to leave it too)."""
        if self.group is not None:
            from megatron_rl.weight_sync.group import destroy_update_group

            self.fleet.destroy_update_group(self.cfg.group_name)
            destroy_update_group(self.group)
            self.group = None

    def _rebuild_if_membership_changed(self) -> None:
        live = set(self.fleet.live_update_urls())
        if self.group is not None and all(u in live for u in self._members):
            return
        self.close()
        self._port += 1  # the old rendezvous store may still hold the port
        self.connect()

    # ------------------------------------------------------------------ sync

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        limit = int(self.cfg.bucket_mb * 2**20)
        cast = getattr(torch, self.cfg.cast_dtype) if self.cfg.cast_dtype else None
        bucket, size = [], 0
        for name, t in iter_model_hf(self.chunks, self.converter):
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
        from megatron_rl.generation.protocol import pack_bucket, update_weights_payload
        from megatron_rl.weight_sync.group import broadcast

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
                futs = self.fleet.update_weights_async(update_weights_payload(
                    names=names, dtypes=dtypes, shapes=shapes, group_name=self.cfg.group_name,
                    weight_version=version))
                try:
                    broadcast(flat, self.group, src=0)
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
                self._port += 1
                self.connect()
            return self.sync(version, _retry=False)
        seconds = time.perf_counter() - t0
        stats = {"weight_sync/seconds": seconds, "weight_sync/pause_s": t_paused - t0,
                 "weight_sync/bytes": float(nbytes), "weight_sync/buckets": float(n_buckets),
                 "weight_sync/tensors": float(n_tensors),
                 "weight_sync/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
                 "weight_sync/version": float(version)}
        if self.rank == 0 and self.cfg.verify:
            stats["weight_sync/verified"] = float(self.verify(digests))
        if self.rank == 0:
            self.history.append(stats)
        return stats

    def verify(self, digests: dict[str, str]) -> bool:
        """Compare the servers' ``/megatron_rl/weights_digest`` (built-in engine only) with the
        digests of what was sent; raises naming the first server and tensor that differ."""
        for url in self.fleet.update_urls:
            theirs = self.fleet.weights_digest(url)
            bad = [n for n, d in digests.items() if theirs.get(n) != d]
            if bad:
                raise RuntimeError(f"weight sync: {url} holds different {bad[0]} "
                                   f"({len(bad)} tensors differ)")
        return True


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (what ``/megatron_rl/weights_digest`` reports per parameter)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                          .tobytes()).hexdigest()


def _sync_group():
    """The ranks that call :meth:`WeightBroadcaster.sync` together (model-parallel ranks of the
    first data-parallel replica), or None for a single rank."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            g = ps.get_model_parallel_group()
            return g if dist.get_world_size(g) > 1 else None
    except ImportError:
        pass
    return None
