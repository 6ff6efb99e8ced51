"""Core attention for Megatron's local (non-Transformer-Engine) layer spec: PyTorch's
``scaled_dot_product_attention``, one causal call per packed sequence, never a ``[T, T]`` mask.

:class:`SegmentCausalAttention` takes the place of Megatron's ``DotProductAttention`` in the
``core_attention`` slot of the local spec (``training/model.py``). Megatron's ``SelfAttention``
hands it the projected, rotated heads in one of two layouts:

- padded rows (``packed_seq_params=None``): ``query [s, b, np, hn]``, ``key``/``value
  [s, b, ng, hn]``; plain causal SDPA over each row. Right padding sits after every real token,
  so no real token attends to it. Returns ``[s, b, np * hn]``.
- packed rows (``PackedSeqParams(qkv_format="thd")``): ``SelfAttention`` squeezes the batch
  dimension, so ``query [t, np, hn]``, ``key``/``value [t, ng, hn]``, and the segments are
  ``cu_seqlens_q`` (int32 starts, last entry ``t``; the row's tail padding is a segment of its
  own). Each segment gets its own causal SDPA call, so attention stays inside a sequence at
  ``sum_i n_i^2`` cost instead of ``t^2`` (and no ``t x t`` mask in memory). ``SelfAttention``
  has already restarted RoPE at every ``cu_seqlens`` entry (``_apply_rotary_pos_emb_thd``), so a
  packed sequence sees exactly what it sees alone. Returns ``[t, np * hn]``.

Grouped-query attention (``ng < np``) goes to SDPA as ``enable_gqa=True``: no repeated copy of the
keys and values. Under tensor parallelism each rank holds ``np / tp`` query heads and
``ng / tp`` key/value groups, as Megatron's ``DotProductAttention`` does.

What it refuses, naming the config field: attention dropout (RL training runs without it;
``transformer_config_from_hf`` sets 0), sliding windows, softmax variants other than vanilla,
context parallelism, and an explicit attention mask or bias (masks are what this replaces).
The scale is ``softmax_scale`` or ``1 / sqrt(hn)``; ``apply_query_key_layer_scaling`` divides the
scores by the layer number and multiplies them back inside Megatron's fp32 softmax, a net factor
of 1, so it changes nothing here either.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SegmentCausalAttention", "segment_causal_attention"]


def segment_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention inside each segment of a packed row.

    ``query [t, np, hn]``, ``key``/``value [t, ng, hn]`` (``np`` a multiple of ``ng``),
    ``cu_seqlens`` the segment starts with ``t`` last (``[0, n_1, n_1 + n_2, ..., t]``). Returns
    ``[t, np, hn]``: row ``i`` of segment ``k`` attends to rows ``cu_seqlens[k] .. i`` only.
    """
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != query.shape[0]:
        raise ValueError(
            f"cu_seqlens: must run from 0 to the {query.shape[0]} packed tokens, got "
            f"{cu_seqlens[:3]}...{cu_seqlens[-1:]} ({len(cu_seqlens)} entries)"
        )
    sizes = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    if min(sizes) < 0:
        raise ValueError(f"cu_seqlens: must not decrease, got {cu_seqlens}")
    gqa = query.shape[1] != key.shape[1]
    outs = []
    # One split per input, not a slice per segment: the backward of a split is one concatenation,
    # that of a slice a zero-filled full-size gradient per segment (O(segments x t) work).
    for q, k, v in zip(*(torch.split(x, sizes) for x in (query, key, value))):
        if q.shape[0] == 0:
            continue
        # [n, heads, hn] -> [1, heads, n, hn]: 4-D inputs, which PyTorch's CPU flash-attention
        # kernel needs (3-D ones, GQA included, fall back to the unfused math path, ~1.4x slower).
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    if not outs:  # no token at all
        return query.new_zeros(query.shape)
    return torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()


class SegmentCausalAttention(torch.nn.Module):
    """Megatron ``core_attention`` module: causal SDPA per row (padded) or per packed sequence
    (``PackedSeqParams`` ``thd``). Same constructor as Megatron's ``DotProductAttention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        """Check the config against what this attention computes and record the per-rank head
        counts (heads and key/value groups split over the tensor-parallel group). ``k_channels``
        / ``v_channels``: multi-latent attention's query/key and value head widths, which differ
        (its heads are all query groups of their own)."""
        from megatron.core.process_groups_config import (
            ProcessGroupCollection,  # lazy: megatron-core takes seconds to import; only this path needs it
        )
        from megatron.core.transformer.enums import (
            AttnMaskType,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        super().__init__()
        del layer_number, attention_type, cp_comm_type, v_channels  # nothing here depends on them
        self.config = config
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout: SegmentCausalAttention runs without dropout, got {dropout}")
        if config.window_size is not None:
            raise ValueError(
                f"window_size: sliding-window attention is not supported, got {config.window_size}"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type: only 'vanilla' is supported, got {config.softmax_type!r}")
        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size: must be 1, got {config.context_parallel_size}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: only causal attention is supported, got {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        for name, n in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_query_groups", config.num_query_groups),
        ):
            if n % tp:
                raise ValueError(f"{name}: {n} is not divisible by the tensor-parallel size {tp}")
        self.heads = config.num_attention_heads // tp  # query heads on this rank
        self.groups = config.num_query_groups // tp  # key/value groups on this rank
        if self.heads % self.groups:
            raise ValueError(
                f"num_query_groups: {config.num_query_groups} does not divide "
                f"num_attention_heads {config.num_attention_heads}"
            )
        self.head_dim = k_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Causal attention of the rotated heads: ``[t, np, hn]`` (packed, per sequence) ->
        ``[t, np * hn]``, or ``[s, b, np, hn]`` (padded, per row) -> ``[s, b, np * hn]``."""
        del attn_mask_type  # causal, checked at construction; SelfAttention passes its own
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: SegmentCausalAttention takes no mask; pass packed rows as "
                "PackedSeqParams(qkv_format='thd') and padded rows with attention_mask=None"
            )
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by SegmentCausalAttention")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(
                    f"packed_seq_params.qkv_format: only 'thd' is supported, got {packed_seq_params.qkv_format!r}"
                )
            cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
            if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_kv, cu_q):
                raise ValueError("packed_seq_params.cu_seqlens_kv: must equal cu_seqlens_q (self-attention)")
            bounds = [int(b) for b in cu_q.tolist()]  # one host copy per layer, as Megatron's RoPE
            out = segment_causal_attention(query, key, value, bounds, self.scale)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.heads != self.groups
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
