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

**Context parallelism** (``context_parallel_size > 1``, packed rows only). Each rank holds two
chunks of every sequence, Megatron's load-balanced zig-zag: with ``C`` ranks a sequence is cut
into ``2C`` chunks of ``c`` tokens and rank ``r`` holds chunks ``r`` and ``2C - 1 - r`` (so every
rank has the same causal work). ``cu_seqlens`` are the whole sequences' bounds (each a multiple of
``2C``), as Megatron's RoPE and Transformer Engine's context-parallel attention take them; the
local segments are ``1 / C`` of them. :class:`_ZigzagAttention` all-gathers the keys and values of
the context-parallel group (Llama 3's long-context recipe) and runs, per local chunk ``m``, two
calls of PyTorch's CPU flash-attention kernel -- the earlier chunks ``0 .. m-1`` without a mask and
chunk ``m`` itself causally -- merged by their log-sum-exps. Nothing of the gathered keys and
values is kept for the backward: it gathers them again, runs the kernel's backward per block with
the merged output and log-sum-exp (exact: the probabilities of each block under the whole row's
normaliser), and sums the key / value gradients over the group, each rank keeping its chunks'.
So a rank's saved activations are its ``1 / C`` share. On GPU, Transformer Engine's attention
does the same through its own context-parallel path (the TE layer spec; ``cp_comm_type``).

What it refuses, naming the config field: attention dropout (RL training runs without it;
``transformer_config_from_hf`` sets 0), sliding windows, softmax variants other than vanilla,
context parallelism on padded rows, and an explicit attention mask or bias (masks are what this
replaces).
The scale is ``softmax_scale`` or ``1 / sqrt(hn)``; ``apply_query_key_layer_scaling`` divides the
scores by the layer number and multiplies them back inside Megatron's fp32 softmax, a net factor
of 1, so it changes nothing here either.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SegmentCausalAttention", "segment_causal_attention", "zigzag_chunks"]


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


def zigzag_chunks(size: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * size``) of every sequence that context-parallel ``rank`` holds."""
    return rank, 2 * size - 1 - rank


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """PyTorch's CPU flash attention on ``[1, heads, n, hn]``: ``(out, logsumexp [1, heads, n])``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _heads_first(x: torch.Tensor, rep: int = 1) -> torch.Tensor:
    """``[n, heads, hn]`` -> ``[1, heads * rep, n, hn]`` (key/value groups repeated for GQA)."""
    x = x.transpose(0, 1).unsqueeze(0)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


class _ZigzagAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag chunks against the whole sequences (see the module
    docstring). ``local`` are the local segment bounds, ``[0, n_1 / C, ...]``."""

    @staticmethod
    def _gather(x: torch.Tensor, group) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return parts

    @staticmethod
    def _full(parts: list[torch.Tensor], lo: int, hi: int, size: int) -> torch.Tensor:
        """Segment ``[lo, hi)`` of every rank's local tensor -> the whole segment, chunks in order."""
        c = (hi - lo) // 2
        chunks: list[torch.Tensor | None] = [None] * (2 * size)
        for j, x in enumerate(parts):
            a, b = zigzag_chunks(size, j)
            chunks[a], chunks[b] = x[lo : lo + c], x[lo + c : hi]
        return torch.cat([x for x in chunks if x is not None])

    @staticmethod
    def _segments(local: list[int], key: torch.Tensor, value: torch.Tensor, group, rep: int):
        """Per non-empty local segment: ``(lo, hi, c, keys, values)`` with the whole segment's keys
        and values gathered from the group, ``[1, heads, n, hn]`` (groups repeated ``rep`` times)."""
        size = group.size()
        keys, values = _ZigzagAttention._gather(key, group), _ZigzagAttention._gather(value, group)
        for lo, hi in zip(local[:-1], local[1:]):
            c = (hi - lo) // 2
            if c:
                k_all = _heads_first(_ZigzagAttention._full(keys, lo, hi, size), rep)
                yield lo, hi, c, k_all, _heads_first(_ZigzagAttention._full(values, lo, hi, size), rep)

    @staticmethod
    def forward(ctx, query, key, value, local, group, scale):
        size, rank = group.size(), group.rank()
        rep = query.shape[1] // key.shape[1]
        out = torch.empty_like(query)
        lses = []
        for lo, _hi, c, k_all, v_all in _ZigzagAttention._segments(local, key, value, group, rep):
            for half, m in enumerate(zigzag_chunks(size, rank)):
                rows = slice(lo + half * c, lo + (half + 1) * c)
                q = _heads_first(query[rows])
                o, lse = _flash(
                    q, k_all[:, :, m * c : (m + 1) * c], v_all[:, :, m * c : (m + 1) * c], True, scale
                )
                if m > 0:  # the earlier chunks, no mask; merged by log-sum-exp
                    o2, lse2 = _flash(q, k_all[:, :, : m * c], v_all[:, :, : m * c], False, scale)
                    both = torch.logaddexp(lse, lse2)
                    o = o * torch.exp(lse - both).unsqueeze(-1) + o2 * torch.exp(lse2 - both).unsqueeze(-1)
                    lse = both
                out[rows] = o[0].transpose(0, 1)
                lses.append(lse)
        ctx.save_for_backward(query, key, value, out, *lses)
        ctx.local, ctx.group, ctx.scale = local, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, *lses = ctx.saved_tensors
        local, group, scale = ctx.local, ctx.group, ctx.scale
        size, rank = group.size(), group.rank()
        groups = key.shape[1]
        rep = query.shape[1] // groups
        grad_q = torch.zeros_like(query)
        grad_k = [torch.zeros_like(key) for _ in range(size)]  # every rank's keys' gradient, here
        grad_v = [torch.zeros_like(value) for _ in range(size)]
        step = iter(lses)
        for lo, hi, c, k_all, v_all in _ZigzagAttention._segments(local, key, value, group, rep):
            dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
            for half, m in enumerate(zigzag_chunks(size, rank)):
                rows = slice(lo + half * c, lo + (half + 1) * c)
                q, o, do, lse = (
                    _heads_first(query[rows]),
                    _heads_first(out[rows]),
                    _heads_first(grad_out[rows]),
                    next(step),
                )
                blocks = [(m * c, (m + 1) * c, True)] + ([(0, m * c, False)] if m > 0 else [])
                for a, b, causal in blocks:
                    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        do, q, k_all[:, :, a:b], v_all[:, :, a:b], o, lse, 0.0, causal, scale=scale
                    )
                    grad_q[rows] += dq[0].transpose(0, 1)
                    dk_all[:, :, a:b] += dk
                    dv_all[:, :, a:b] += dv
            # [1, heads, n, hn] -> [n, groups, hn] (the repeated heads summed), back to each rank
            for full, grads in ((dk_all, grad_k), (dv_all, grad_v)):
                full = full[0].unflatten(0, (groups, rep)).sum(1).transpose(0, 1)
                for j in range(size):
                    a, b = zigzag_chunks(size, j)
                    grads[j][lo : lo + c] += full[a * c : (a + 1) * c]
                    grads[j][lo + c : hi] += full[b * c : (b + 1) * c]
        # Each rank computed every rank's key/value gradient from its own queries: sum them.
        total_k, total_v = torch.stack(grad_k), torch.stack(grad_v)
        dist.all_reduce(total_k, group=group)
        dist.all_reduce(total_v, group=group)
        return grad_q, total_k[rank], total_v[rank], None, None, None


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
        del layer_number, attention_type, cp_comm_type  # nothing here depends on them
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
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: only causal attention is supported, got {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        # The context-parallel group when sequences are split over it (None: whole sequences).
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if config.context_parallel_size > 1 and cp is not None and cp.size() > 1 else None
        if config.context_parallel_size > 1 and self.cp_group is None:
            raise ValueError(
                f"context_parallel_size: {config.context_parallel_size}, but no context-parallel group of that "
                f"size was given (init_parallel sets it up)"
            )
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
        if self.cp_group is not None and v_channels is not None and v_channels != self.head_dim:
            raise ValueError(
                f"context_parallel_size: the CPU context-parallel attention needs equal query/key and value "
                f"head widths, got {self.head_dim} and {v_channels} (multi-latent attention: use "
                f"Transformer Engine's, on GPU)"
            )
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
            if self.cp_group is not None:
                size = self.cp_group.size()
                if any(b % (2 * size) for b in bounds) or bounds[-1] != query.shape[0] * size:
                    raise ValueError(
                        f"packed_seq_params.cu_seqlens_q: under context parallelism {size} each sequence "
                        f"must be a multiple of {2 * size} tokens and the bounds those of the whole "
                        f"sequences ({query.shape[0]} local tokens x {size}), got ...{bounds[-3:]}"
                    )
                local = [b // size for b in bounds]
                out = _ZigzagAttention.apply(query, key, value, local, self.cp_group, self.scale)
                return out.reshape(out.shape[0], -1)
            out = segment_causal_attention(query, key, value, bounds, self.scale)
            return out.reshape(out.shape[0], -1)
        if self.cp_group is not None:
            raise ValueError(
                "context_parallel_size: context parallelism splits packed rows only (batching.layout: packed)"
            )
        s, b = query.shape[:2]
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.heads != self.groups
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
