"""A checkpoint's RNG states: saved per rank, restored exactly at the same layout, reseeded
deterministically at another.

Every rank saves its RNG states (python, numpy, torch CPU/CUDA, Megatron's tensor-parallel
tracker) as plain tensors and numbers in ``rng/rank_R.pt`` (:func:`write_rng`), with the
:class:`RankLayout` it was written at. :func:`restore_or_reseed` gives every rank back its own
states when the layout (same world size, TP, PP, DP, chunks) and the device kind are the same. At
another layout there is no one-to-one map from old ranks to new ones, so every rank is reseeded
deterministically from ``(seed, step)`` and its TP rank, exactly as
:func:`~megatron_rl.training.parallel.init_parallel` seeds a fresh run (one default-generator
seed for all ranks, a tracker stream per TP rank) -- the rank enters through its TP coordinate
only because ranks that hold replicated activations must draw the same dropout masks. ``seed`` is
the one given to :func:`~megatron_rl.training.checkpoint.save_checkpoint`, or, if none was, a
digest of rank 0's saved generator state. Training with dropout 0 (this project's default) does
not consume these RNGs at all.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.training.checkpoint_manifest import RNG_DIR, CheckpointError

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy this name is Any.
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.fileio import JsonValue

__all__ = ["RankLayout", "capture_rng", "rank_layout", "restore_or_reseed", "rng_device", "write_rng"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankLayout:
    """Where each rank's shard and RNG streams came from; equal layouts map rank r to rank r."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    model_chunks: int  # > 1 with interleaved (virtual) pipeline stages


def rank_layout(chunks: list[GPTModel]) -> RankLayout:
    """The layout these (unwrapped) chunks were built for, read from their process groups."""
    pgs = chunks[0].pg_collection
    world, tp, pp = dist.get_world_size(), pgs.tp.size(), pgs.pp.size()
    return RankLayout(
        world_size=world,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=world // (tp * pp),
        model_chunks=len(chunks),
    )


def rng_device() -> str:
    """``cuda`` or ``cpu``: the kind of generator states this process saves and can restore."""
    # CUDA generator states (and the tracker's, which are CUDA states on GPU) cannot be set on a
    # CPU-only machine, so a device change counts as a layout change for the RNG.
    return "cuda" if torch.cuda.is_available() else "cpu"


def capture_rng() -> dict[str, object]:
    """This rank's RNG states as plain tensors, numbers and tuples (``weights_only``-loadable)."""
    from megatron.core.tensor_parallel import (
        get_cuda_rng_tracker,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    legacy = np.random.get_state()
    if isinstance(legacy, dict):  # only if someone replaced the global generator's MT19937
        raise CheckpointError("numpy's global generator is not MT19937; its state cannot be saved")
    kind, keys, pos, has_gauss, gauss = legacy
    state: dict[str, object] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch_cpu": torch.get_rng_state(),
        "tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:  # Any: the tuples and tensors capture_rng stored
    """Inverse of :func:`capture_rng`."""
    from megatron.core.tensor_parallel import (
        get_cuda_rng_tracker,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state:
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    tracker = get_cuda_rng_tracker()
    if state["tracker"]:
        tracker.set_states(dict(state["tracker"]))


def _reseed_rng(base_seed: int, step: int, tp_rank: int) -> None:
    """Seed every generator from ``(base_seed, step)`` the way ``init_parallel`` seeds a new run.

    The 32-bit seed (numpy's limit) comes from a hash, so nearby steps get unrelated streams.
    """
    from megatron.core import (
        tensor_parallel,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    digest = hashlib.sha256(f"megatron-rl-reseed:{base_seed}:{step}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank)


def _rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank_{rank:05d}.pt"


def _state_seed(ckpt: Path) -> int:
    """A seed that is a deterministic function of the checkpoint: rank 0's torch generator."""
    state = torch.load(_rng_file(ckpt, 0), weights_only=True)
    return int.from_bytes(hashlib.sha256(state["torch_cpu"].numpy().tobytes()).digest()[:8], "little")


def write_rng(ckpt: Path, rank: int, layout: RankLayout, state: dict[str, object]) -> None:
    """Write this rank's RNG ``state`` (:func:`capture_rng`) and the layout it belongs to."""
    torch.save({"layout": asdict(layout), "rank": rank, **state}, _rng_file(ckpt, rank))


def restore_or_reseed(
    ckpt: Path, marker: dict[str, JsonValue], saved: RankLayout, layout: RankLayout, chunks: list[GPTModel]
) -> None:
    """Exact RNG states at the same layout and device kind; a deterministic reseed otherwise."""
    rank = dist.get_rank()
    if saved == layout and marker["rng_device"] == rng_device():
        state = torch.load(_rng_file(ckpt, rank), weights_only=True)
        if RankLayout(**state["layout"]) != layout or state["rank"] != rank:
            raise CheckpointError(
                f"{_rng_file(ckpt, rank)} was written by rank {state['rank']} "
                f"of layout {state['layout']}, not rank {rank} of {layout}"
            )
        _restore_rng(state)
        return
    seed = marker["seed"] if marker["seed"] is not None else _state_seed(ckpt)
    log.info(
        "checkpoint %s: written at %s on %s, loaded at %s on %s; RNGs reseeded from (seed, step=%d)",
        ckpt,
        saved,
        marker["rng_device"],
        layout,
        rng_device(),
        marker["step"],
    )
    _reseed_rng(seed, int(marker["step"]), tp_rank=chunks[0].pg_collection.tp.rank())
