"""How a full Megatron-Core model (TP=1, PP=1, global layer numbers) is spread over parallel ranks:
which pipeline stage holds a layer, and how each parameter splits over tensor-parallel ranks. The
trainer's model chunks (:mod:`megatron_rl.training.chunks`, behind both the live weight broadcast
and the checkpoint export) go through it between a rank's tensors and the full ones that the name
map (:mod:`megatron_rl.hf.layout`) converts.

Tensor parallelism (:func:`tp_split`, :func:`shard_for_tp`, :func:`gather_from_tp`): column-
parallel weights split dim 0 (fused QKV -- contiguous because it is laid out by query group -- the
vocabulary of the embedding and output layer), row-parallel ones dim 1 (``linear_proj``,
``linear_fc2``); SwiGLU's ``fc1`` splits gate and up separately so that rank r holds
``[gate_r; up_r]`` (each expert's ``fc1`` alike: experts are TP-sharded like the dense MLP); norms,
the router and row-parallel biases are replicated.

Pipeline parallelism: a stage (or virtual-pipeline chunk) numbers its layers from 0; the global
number adds the stage's :func:`layer_offset` (:func:`to_global_name`, :func:`to_local_name`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from megatron_rl.hf.tensor_maps import MCORE_LAYER

__all__ = [
    "TPSplit",
    "gather_from_tp",
    "layer_offset",
    "shard_for_tp",
    "to_global_name",
    "to_local_name",
    "tp_split",
]


# --------------------------------------------------------------------------- pipeline stages


def layer_offset(
    num_layers: int, *, pp_rank: int, pp_size: int, vp_stage: int | None = None, vp_size: int | None = None
) -> int:
    """Global index of the first layer held by pipeline rank ``pp_rank`` (virtual stage
    ``vp_stage`` of ``vp_size`` under interleaving), for Megatron's even split.

    Without interleaving stage r holds layers ``[r L/p, (r+1) L/p)``. With ``v`` virtual stages
    each rank holds ``v`` chunks of ``n = L / (p v)`` layers and chunk c of rank r starts at
    ``(c p + r) n`` (chunks go round the ranks first), as in Megatron's
    ``get_transformer_layer_offset``. Uneven splits are not covered: for a built model use the
    model's own numbering (``layer.layer_number - 1``).
    """
    chunks = pp_size * (vp_size or 1)
    if num_layers % chunks:
        raise ValueError(f"num_layers: {num_layers} does not split evenly into {chunks} chunks")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank: {pp_rank} outside [0, {pp_size})")
    # (vp_stage is not None follows from the first test; it is spelt out for the type checker)
    if (vp_size is None) != (vp_stage is None) or (
        vp_size and vp_stage is not None and not 0 <= vp_stage < vp_size
    ):
        raise ValueError(f"vp_stage: {vp_stage} does not fit vp_size={vp_size}")
    return ((vp_stage or 0) * pp_size + pp_rank) * (num_layers // chunks)


def to_global_name(local_name: str, offset: int) -> str:
    """A stage's parameter name with its layer number made global (``offset`` added)."""
    m = MCORE_LAYER.match(local_name)
    if not m:
        return local_name
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"


def to_local_name(global_name: str, offset: int, num_local_layers: int) -> str | None:
    """The stage-local name of a global layer parameter, or None when another stage holds it.
    Names outside ``decoder.layers`` come back unchanged (which stage has them is the caller's
    business: the embedding is on the first stage, the final norm and output on the last)."""
    m = MCORE_LAYER.match(global_name)
    if not m:
        return global_name
    local = int(m.group(1)) - offset
    if not 0 <= local < num_local_layers:
        return None
    return f"decoder.layers.{local}.{m.group(2)}"


# --------------------------------------------------------------------------- tensor parallelism


class TPSplit(enum.Enum):
    """How a parameter is divided over tensor-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds the full tensor
    COLUMN = "column"  # dim 0 cut into tp contiguous pieces
    ROW = "row"  # dim 1 cut into tp contiguous pieces
    SWIGLU = "swiglu"  # dim 0 = [gate; up], each half cut in tp pieces: rank r = [gate_r; up_r]


_TP_RULES: tuple[tuple[str, TPSplit], ...] = (
    ("embedding.word_embeddings.weight", TPSplit.COLUMN),  # vocab-parallel
    ("output_layer.weight", TPSplit.COLUMN),  # vocab-parallel logits
    (".self_attention.linear_qkv.weight", TPSplit.COLUMN),
    (".self_attention.linear_qkv.bias", TPSplit.COLUMN),
    (".self_attention.linear_proj.weight", TPSplit.ROW),
    (".self_attention.linear_proj.bias", TPSplit.REPLICATED),  # added after the all-reduce
    (".mlp.linear_fc1.weight", TPSplit.SWIGLU),
    (".mlp.linear_fc1.bias", TPSplit.SWIGLU),
    (".mlp.linear_fc2.weight", TPSplit.ROW),
    (".mlp.linear_fc2.bias", TPSplit.REPLICATED),
    (".mlp.router.weight", TPSplit.REPLICATED),  # every TP rank routes all its tokens
    (".mlp.router.expert_bias", TPSplit.REPLICATED),
    # Multi-latent attention: every projection column-parallel (the down projections' latents
    # are gathered again before their norms), the output row-parallel (above).
    (".self_attention.linear_q_proj.weight", TPSplit.COLUMN),
    (".self_attention.linear_q_down_proj.weight", TPSplit.COLUMN),
    (".self_attention.linear_q_up_proj.weight", TPSplit.COLUMN),
    (".self_attention.linear_kv_down_proj.weight", TPSplit.COLUMN),
    (".self_attention.linear_kv_up_proj.weight", TPSplit.COLUMN),
    (".linear_fc1.weight", TPSplit.SWIGLU),  # an expert's fc1 (...local_experts.e.linear_fc1)
    (".linear_fc2.weight", TPSplit.ROW),
    (".layer_norm_weight", TPSplit.REPLICATED),
    (".layer_norm_bias", TPSplit.REPLICATED),
    ("layernorm.weight", TPSplit.REPLICATED),  # input_ / pre_mlp_ / final_layernorm
    ("layernorm.bias", TPSplit.REPLICATED),
)


def tp_split(name: str) -> TPSplit:
    """The TP layout of Megatron parameter ``name`` (either spelling, any layer numbering).
    Raises KeyError for a name it does not know rather than guess "replicated"."""
    for suffix, split in _TP_RULES:
        if name.endswith(suffix):
            return split
    raise KeyError(f"no tensor-parallel layout known for Megatron parameter {name!r}")


def _pieces(size: int, tp_size: int, name: str, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{name}: {what} of size {size} does not split into {tp_size} TP ranks")
    return size // tp_size


def shard_for_tp(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The part of the full (TP=1) tensor ``full`` that TP rank ``tp_rank`` of ``tp_size`` holds.

    Returns a view where the layout allows one (COLUMN, ROW, REPLICATED) and a new tensor for
    SWIGLU. Raises ValueError when the split dimension does not divide by ``tp_size``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} outside [0, {tp_size})")
    split = tp_split(name)
    if split is TPSplit.REPLICATED or tp_size == 1:
        return full
    if split is TPSplit.SWIGLU:
        half = _pieces(full.shape[0], 2, name, "dim 0 ([gate; up])")
        n = _pieces(half, tp_size, name, "each of gate / up")
        gate, up = full[:half], full[half:]
        return torch.cat([gate[tp_rank * n : (tp_rank + 1) * n], up[tp_rank * n : (tp_rank + 1) * n]])
    dim = 0 if split is TPSplit.COLUMN else 1
    n = _pieces(full.shape[dim], tp_size, name, f"dim {dim}")
    return full.narrow(dim, tp_rank * n, n)


def gather_from_tp(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the shards of TP ranks ``0..tp-1`` (inverse of :func:`shard_for_tp`).

    Replicated parameters return ``shards[0]`` (the ranks hold equal copies; not checked here).
    """
    if not shards:
        raise ValueError(f"{name}: no shards to gather")
    split = tp_split(name)
    if split is TPSplit.REPLICATED or len(shards) == 1:
        return shards[0]
    if split is TPSplit.SWIGLU:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0 if split is TPSplit.COLUMN else 1)
