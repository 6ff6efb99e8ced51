"""The trainer side of colocated mode: the generators give their memory back while the trainer
runs, and take the new weights *by reference* afterwards, with no update group.

    push = TensorPusher(trainer.hf_tensors, fleet, WeightSyncConfig())
    push.sync(version=step)        # the fleet gets the trainer's weights (no group to build)
    ...generate a batch...
    push.release()                 # /release_memory_occupation: KV cache, weights, CUDA graphs
    ...train...
    push.sync(version=step + 1)    # resume weights -> /update_weights_from_tensor -> resume KV

As verl and slime do it on one node (SGLang started with ``--enable-memory-saver``): the weights
come back first and are written while the KV cache is still released, so the two never hold
the device together with the trainer's new weights; then the KV cache. Each bucket
(``weight_sync.bucket_mb``) is one ``/update_weights_from_tensor`` inside one
``/begin_weight_update`` ... ``/end_weight_update`` session: the named tensors serialized as SGLang's
``MultiprocessingSerializer`` does (``protocol.serialize_named_tensors``), so a CUDA tensor
travels as a CUDA IPC handle (SGLang on the same GPU opens it) and a CPU tensor as a shared
memory segment (the built-in engine on the same host maps it). The tensors are the trainer's
``hf_tensors`` (TP/PP shards gathered into HF names on rank 0: the same name map the broadcast
uses), in the model's dtype unless ``weight_sync.cast_dtype`` says otherwise.

Collective over the trainer's ranks like :class:`~.broadcast.WeightBroadcaster` (every rank calls
:meth:`sync`; rank 0 alone talks to the fleet).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megatron_rl.generation.protocol import serialize_named_tensors, tensor_digest
from megatron_rl.weight_sync.broadcast import WeightBroadcaster

__all__ = ["TensorPusher"]

# What a colocated step releases (SGLang 0.5.23's three regions), and the order it takes it back.
_RELEASE = ("kv_cache", "weights", "cuda_graph")
_RESUME_FIRST = ("weights",)
_RESUME_AFTER = ("kv_cache", "cuda_graph")


class TensorPusher(WeightBroadcaster):
    """Colocated weight updates (see the module docstring): :meth:`release` before the trainer
    runs, :meth:`sync` after it. Shares the broadcaster's bucketing, casting and verification;
    builds no update group."""

    released = False  # whether the fleet's memory is released now (rank 0)

    def connect(self) -> None:
        """Nothing to join: the fleet is reached over HTTP only (rank 0 reads its state)."""
        if self.rank == 0:
            self.fleet.refresh()

    def close(self) -> None:
        """Nothing to leave (no update group)."""

    def release(self) -> dict[str, float]:
        """Ask the fleet to free its KV cache, weights and CUDA graphs (rank 0; the servers must
        be idle); its timing."""
        if self.rank != 0:
            return {}
        t0 = time.perf_counter()
        self.fleet.release_memory(list(_RELEASE))
        self.released = True
        return {"colocate/release_s": time.perf_counter() - t0}

    def sync(self, version: int, *, _retry: bool = True) -> dict[str, float]:
        """Give the fleet its memory back (if released) and the trainer's weights as ``version``;
        timings on rank 0. A server's refusal raises (naming it and the first bad tensor) after
        every rank has finished the gathers."""
        t0 = time.perf_counter()
        failure: BaseException | None = None
        if self.rank == 0:
            self.fleet.refresh()
            if self.released:
                self.fleet.resume_memory(list(_RESUME_FIRST))
            self.fleet.begin_update()
        t_resumed = time.perf_counter()
        nbytes, n_buckets, n_tensors = 0, 0, 0
        digests: dict[str, str] = {}
        try:
            for bucket in self._buckets():  # rank 0 only gets buckets; the others gather
                if failure is not None:
                    continue  # keep the collective gathers in step; nothing more is sent
                try:
                    if self.cfg.verify:
                        digests.update((n, tensor_digest(t)) for n, t in bucket)
                    self.fleet.update_weights_from_tensor(
                        serialize_named_tensors(bucket), weight_version=version
                    )
                except Exception as e:  # noqa: BLE001 - raised below, once every rank is done
                    failure = e
                    continue
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                n_buckets += 1
                n_tensors += len(bucket)
        finally:
            if self.rank == 0:
                calls: list[Callable[[], object]] = [self.fleet.end_update]
                if self.released:
                    calls.append(lambda: self.fleet.resume_memory(list(_RESUME_AFTER)))
                for call in calls:
                    try:
                        call()
                    except Exception as e:  # noqa: BLE001
                        failure = failure or e
                self.released = False
        if self._agree(failure is not None):
            raise RuntimeError(f"colocated weight push failed: {failure}") from failure
        seconds = time.perf_counter() - t0
        stats = {
            "weight_sync/seconds": seconds,
            "weight_sync/pause_s": t_resumed - t0,  # here: resuming the weights' memory
            "weight_sync/bytes": float(nbytes),
            "weight_sync/buckets": float(n_buckets),
            "weight_sync/tensors": float(n_tensors),
            "weight_sync/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
            "weight_sync/version": float(version),
        }
        if self.rank == 0 and self.cfg.verify:
            stats["weight_sync/verified"] = float(self.verify(digests))
        if self.rank == 0:  # servers back from a death got these weights too: route them again
            self.fleet.admit(self.fleet.held_urls(), held_before=t0)  # held after t0: may have missed some
        return stats
