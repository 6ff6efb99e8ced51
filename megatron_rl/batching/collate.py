"""Microbatch collation: which sequences share a microbatch, and the tensors a microbatch becomes.

Planning (Magistral's greedy collation): sort the minibatch's sequences by length, longest first,
and put each into the first microbatch that still has room under a fixed token budget, opening a
new one when none has. The baseline ``uniform`` fills microbatches in arrival order and opens a new
one whenever the next sequence does not fit (no sorting, no going back).

Two layouts, one planner; the cost of a microbatch under each is what the budget bounds:

- ``packed`` (default): the sequences are concatenated into one row; attention stays inside each
  sequence and positions restart at 0 for each. The row carries ``cu_seqlens`` (cumulative
  sequence starts, int32), which is what Megatron-Core's ``PackedSeqParams`` (``qkv_format="thd"``)
  takes for Transformer Engine's variable-length attention on GPU; the local (non-TE) attention on
  CPU gets the same packing as a block-diagonal causal mask from :meth:`Microbatch.attention_mask`.
  Cost = total tokens. Packing wastes nothing but the rounding to ``pad_to_multiple``.
- ``padded``: one row per sequence, right-padded to the longest in the microbatch; works with every
  attention kernel without varlen support. Cost = rows x longest row.

Context parallelism (``trainer.parallel.context_parallel`` = C > 1, packed only): each sequence
is laid out in a segment padded to a multiple of ``2C`` (``segment_multiple``; the padding carries
no loss), and :func:`split_for_context_parallel` gives each rank its two zig-zag chunks of every
segment (Megatron's load-balanced split: chunk ``r`` and ``2C - 1 - r``). The split microbatch
keeps the whole sequences' ``cu_seqlens`` (what Megatron's RoPE and the attention take) and its
source, so per-sequence values computed on the chunks can be put back in order
(:meth:`Microbatch.unsplit`). The token budget bounds the whole microbatch: a rank holds 1/C of it.

MoE routing replay: when the sequences carry the experts the generator routed each position to
(``TrainSequence.routed_experts``), the microbatch holds them per position (``[R, S, layers,
top_k]``); a sequence's last position (never fed to the generator) and padding get experts ``0 ..
top_k-1``, which route only positions whose outputs no loss reads.

Filling out a step (for the trainer's schedule): :func:`filler_microbatch` is a microbatch that
carries no loss, for a data-parallel replica with fewer sequences than the microbatches every
replica must run (each one joins the step's collectives); :func:`pad_microbatch` grows a
microbatch to a given ``[rows, width]`` with padding that carries no loss (filler experts where
routing is replayed), for a pipeline schedule that needs one shape for every microbatch of a step.

Causal-LM alignment: position ``p`` predicts token ``p + 1`` of the same sequence. Completion token
``j`` of a sequence with prompt length ``P`` is the label at position ``P + j - 1``; every per-token
field (loss weight, advantage, behaviour log-prob, version) sits at that position. Prompt
positions, each sequence's last position and padding carry weight 0, and so do the environment's
tokens of a multi-turn trajectory (``TrainSequence.loss_mask``): the loss, its metrics and the
normaliser see only tokens the model sampled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.types import TrainBatch, TrainSequence

Layout = Literal["packed", "padded"]
Strategy = Literal["greedy", "uniform"]

__all__ = [
    "PER_POSITION_FIELDS",
    "CollationStats",
    "Layout",
    "Microbatch",
    "Strategy",
    "build_microbatches",
    "collate",
    "collation_stats",
    "filler_microbatch",
    "filler_routing",
    "microbatch_cost",
    "pad_microbatch",
    "plan_microbatches",
    "split_for_context_parallel",
]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def microbatch_cost(lengths: Sequence[int], layout: Layout, pad_to_multiple: int = 1) -> int:
    """Token slots a microbatch of these sequence lengths occupies."""
    if not lengths:
        return 0
    if layout == "packed":
        return _round_up(sum(lengths), pad_to_multiple)
    if layout == "padded":
        return len(lengths) * _round_up(max(lengths), pad_to_multiple)
    raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")


def plan_microbatches(
    lengths: Sequence[int],
    token_budget: int,
    *,
    layout: Layout = "packed",
    strategy: Strategy = "greedy",
    pad_to_multiple: int = 1,
) -> list[list[int]]:
    """Assign sequence indices to microbatches whose cost stays within ``token_budget``.

    Args:
        lengths: total length (prompt + completion) of each sequence.
        token_budget: the largest cost a microbatch may have (see :func:`microbatch_cost`).
        strategy: ``greedy`` (first-fit decreasing) or ``uniform`` (arrival order, next-fit).
    Returns:
        Lists of indices into ``lengths``, one list per microbatch; every index appears once.
    """
    for i, n in enumerate(lengths):
        if microbatch_cost([n], layout, pad_to_multiple) > token_budget:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the microbatch token budget "
                f"{token_budget} (batching.token_budget must be >= the longest sequence)"
            )
    if strategy == "uniform":
        bins: list[list[int]] = []
        for i in range(len(lengths)):
            if (
                bins
                and microbatch_cost([lengths[j] for j in bins[-1]] + [lengths[i]], layout, pad_to_multiple)
                <= token_budget
            ):
                bins[-1].append(i)
            else:
                bins.append([i])
        return bins
    if strategy != "greedy":
        raise ValueError(f"strategy must be 'greedy' or 'uniform', got {strategy!r}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins = []
    used: list[int] = []  # tokens per bin (packed)
    longest: list[int] = []  # per bin its first sequence, the longest (padded)
    for i in order:
        n = lengths[i]
        for b in range(len(bins)):
            if layout == "packed":
                fits = _round_up(used[b] + n, pad_to_multiple) <= token_budget
            else:  # sorted descending: the bin's first sequence is its longest
                fits = (len(bins[b]) + 1) * _round_up(longest[b], pad_to_multiple) <= token_budget
            if fits:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
            longest.append(n)
    return bins


@dataclass
class CollationStats:
    """How well a plan uses fixed-size microbatches of ``token_budget`` slots."""

    microbatches: int
    lower_bound: int  # ceil(total tokens / budget): no plan can use fewer
    total_tokens: int
    padding_fraction: float  # 1 - tokens / (microbatches x budget): fixed-size microbatches
    shape_padding_fraction: float  # 1 - tokens / sum(costs): microbatches sized to their content

    @property
    def over_lower_bound(self) -> float:
        return self.microbatches / max(1, self.lower_bound)


def collation_stats(
    lengths: Sequence[int],
    bins: list[list[int]],
    token_budget: int,
    layout: Layout = "packed",
    pad_to_multiple: int = 1,
) -> CollationStats:
    total = int(sum(lengths))
    slots = len(bins) * token_budget
    cost = sum(microbatch_cost([lengths[i] for i in b], layout, pad_to_multiple) for b in bins)
    return CollationStats(
        microbatches=len(bins),
        lower_bound=math.ceil(total / token_budget),
        total_tokens=total,
        padding_fraction=1.0 - total / slots if slots else 0.0,
        shape_padding_fraction=1.0 - total / cost if cost else 0.0,
    )


@dataclass
class Microbatch:
    """Tensors of one microbatch, ``[R, S]`` each (``R = 1`` when packed)."""

    layout: Layout
    tokens: torch.Tensor  # [R, S] int64 input ids
    position_ids: torch.Tensor  # [R, S] int64, restarting at 0 for every sequence
    labels: torch.Tensor  # [R, S] int64 next token (0 where there is none)
    loss_weights: torch.Tensor  # [R, S] float32 per-token loss weight; 0 = no loss here
    advantages: torch.Tensor  # [R, S] float32
    behaviour_logprobs: torch.Tensor  # [R, S] float32
    versions: torch.Tensor  # [R, S] int64 policy version of the label token; -1 = none
    loss_mask: torch.Tensor  # [R, S] bool: positions whose label is a completion token
    seq_index: list[int]  # which sequences of the batch, in row / segment order
    seq_lengths: list[int]
    cu_seqlens: torch.Tensor | None = None  # [n + 1] int32 segment starts in the packed row
    routed_experts: torch.Tensor | None = None  # [R, S, layers, top_k] int64 (routing replay)
    proximal_logprobs: torch.Tensor | None = None  # [R, S] float32 (decoupled objective), or None
    # Context parallelism: the whole microbatch this one is a rank's chunks of, and for each of
    # its positions the position in the source row (None: not split).
    cp_source: Microbatch | None = None
    cp_index: torch.Tensor | None = None  # [S] int64

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lengths)

    def unsplit(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values ``[1, S]`` of a context-parallel split -> ``[1, S_source]`` of the
        source microbatch, zeros at the positions other ranks hold (so a sum over the group
        assembles them)."""
        if self.cp_source is None or self.cp_index is None:
            return values
        out = values.new_zeros(self.cp_source.tokens.shape)
        out[0, self.cp_index.to(values.device)] = values[0]
        return out

    def attention_mask(self) -> torch.Tensor:
        """``[R, 1, S, S]`` bool, True where attention is *not* allowed (Megatron's convention):
        causal within each sequence, nothing across sequences or into padding."""
        _r, s = self.tokens.shape
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        if self.layout == "packed":
            cu = self.packed_cu_seqlens()
            seg = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
            allowed = causal & (seg[:, None] == seg[None, :])
            return (~allowed).view(1, 1, s, s)
        valid = torch.arange(s)[None, :] < torch.tensor(self.seq_lengths)[:, None]  # [R, S]
        allowed = causal[None] & valid[:, None, :] & valid[:, :, None]
        # Padding queries attend to themselves only, so softmax rows are never empty.
        allowed |= torch.eye(s, dtype=torch.bool)[None]
        return (~allowed).unsqueeze(1)

    def split_per_sequence(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-position ``[R, S]`` values (e.g. recomputed log-probs) -> one ``[C_i]`` tensor of
        completion-token values per sequence, in ``seq_index`` order (of a context-parallel
        split: this rank's values in place, zeros elsewhere)."""
        if self.cp_source is not None:
            return self.cp_source.split_per_sequence(self.unsplit(values))
        out: list[torch.Tensor] = []
        for k, (start, n) in enumerate(self._segments()):
            row = 0 if self.layout == "packed" else k
            w = self.loss_mask[row, start : start + n].to(values.device)
            out.append(values[row, start : start + n][w])
        return out

    def _segments(self) -> list[tuple[int, int]]:
        if self.layout == "packed":
            cu = self.packed_cu_seqlens()
            return [(int(cu[k]), n) for k, n in enumerate(self.seq_lengths)]
        return [(0, n) for n in self.seq_lengths]

    def packed_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens`` of a packed microbatch (``collate`` always sets it for that layout)."""
        if self.cu_seqlens is None:
            raise ValueError("a packed Microbatch needs cu_seqlens (the segment starts)")
        return self.cu_seqlens


def _place(seq: TrainSequence, fields: dict[str, torch.Tensor], row: int, start: int) -> None:
    n, p = seq.length, seq.prompt_length
    fields["tokens"][row, start : start + n] = seq.tokens
    fields["position_ids"][row, start : start + n] = torch.arange(n)
    fields["labels"][row, start : start + n - 1] = seq.tokens[1:]
    lo, hi = start + p - 1, start + n - 1  # label positions of the completion tokens
    fields["mask"][row, lo:hi] = True
    if seq.loss_mask is None:
        fields["loss_weights"][row, lo:hi] = seq.weight
    else:  # a multi-turn trajectory: the environment's tokens are context, weight 0
        fields["loss_weights"][row, lo:hi] = seq.loss_mask.to(torch.float32) * seq.weight
    fields["advantages"][row, lo:hi] = seq.advantage
    fields["behaviour_logprobs"][row, lo:hi] = seq.behaviour_logprobs
    fields["versions"][row, lo:hi] = seq.versions


def collate(
    sequences: list[TrainSequence],
    seq_index: list[int],
    *,
    layout: Layout = "packed",
    pad_to_multiple: int = 1,
    pad_id: int = 0,
    segment_multiple: int = 1,
) -> Microbatch:
    """Lay the given sequences out as one microbatch (see the module docstring). Packed:
    ``segment_multiple`` rounds each sequence's segment (and the row) up to a multiple of it."""
    lengths = [s.length for s in sequences]
    if segment_multiple > 1 and layout != "packed":
        raise ValueError("segment_multiple: context parallelism splits packed rows only (layout 'packed')")
    spans = [_round_up(n, segment_multiple) for n in lengths]  # each sequence's segment
    if layout == "packed":
        rows, width = 1, _round_up(sum(spans), math.lcm(pad_to_multiple, segment_multiple))
    elif layout == "padded":
        rows, width = len(sequences), _round_up(max(lengths), pad_to_multiple)
    else:
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    f = {
        "tokens": torch.full((rows, width), pad_id, dtype=torch.long),
        "position_ids": torch.zeros(rows, width, dtype=torch.long),
        "labels": torch.zeros(rows, width, dtype=torch.long),
        "mask": torch.zeros(rows, width, dtype=torch.bool),
        "loss_weights": torch.zeros(rows, width, dtype=torch.float32),
        "advantages": torch.zeros(rows, width, dtype=torch.float32),
        "behaviour_logprobs": torch.zeros(rows, width, dtype=torch.float32),
        "versions": torch.full((rows, width), -1, dtype=torch.long),
    }
    starts = [0] * len(sequences)
    if layout == "packed":
        starts = [0] + list(torch.tensor(spans).cumsum(0)[:-1].tolist())
    for k, seq in enumerate(sequences):
        _place(seq, f, 0 if layout == "packed" else k, starts[k])
    routed = _routing(sequences, rows, width, starts, layout)
    proximal = _proximal(sequences, rows, width, starts, layout)
    cu = None
    if layout == "packed":
        bounds = [0] + list(torch.tensor(spans).cumsum(0).tolist())
        if bounds[-1] < width:  # the tail padding is a segment of its own
            bounds.append(width)
        cu = torch.tensor(bounds, dtype=torch.int32)
        for start, n, span in zip(starts, lengths, spans):  # a segment's padding continues its positions
            f["position_ids"][0, start + n : start + span] = torch.arange(n, span)
        f["position_ids"][0, sum(spans) :] = torch.arange(width - sum(spans))
    return Microbatch(
        layout=layout,
        tokens=f["tokens"],
        position_ids=f["position_ids"],
        labels=f["labels"],
        loss_weights=f["loss_weights"],
        advantages=f["advantages"],
        behaviour_logprobs=f["behaviour_logprobs"],
        versions=f["versions"],
        loss_mask=f["mask"],
        seq_index=list(seq_index),
        seq_lengths=lengths,
        cu_seqlens=cu,
        routed_experts=routed,
        proximal_logprobs=proximal,
    )


def _proximal(
    sequences: list[TrainSequence], rows: int, width: int, starts: list[int], layout: Layout
) -> torch.Tensor | None:
    """The microbatch's proximal log-probs at the label positions of the completion tokens (0
    elsewhere), or None when no sequence carries them; ValueError when only some do."""
    given = [s.proximal_logprobs for s in sequences if s.proximal_logprobs is not None]
    if not given:
        return None
    if len(given) != len(sequences):
        raise ValueError("proximal_logprobs: some sequences carry them and others do not")
    out = torch.zeros(rows, width, dtype=torch.float32)
    for k, (seq, values) in enumerate(zip(sequences, given)):
        row, start = (0, starts[k]) if layout == "packed" else (k, 0)
        out[row, start + seq.prompt_length - 1 : start + seq.length - 1] = values
    return out


def filler_routing(rows: int, width: int, layers: int, top_k: int) -> torch.Tensor:
    """``[rows, width, layers, top_k]`` experts ``0 .. top_k-1`` everywhere: the routing of
    positions whose outputs no loss reads (padding, a sequence's last position)."""
    return torch.arange(top_k).expand(rows, width, layers, top_k).clone()


def _routing(
    sequences: list[TrainSequence], rows: int, width: int, starts: list[int], layout: Layout
) -> torch.Tensor | None:
    """The microbatch's routed experts (see the module docstring), or None when no sequence
    carries them; ValueError when only some do, or their layer / top-k counts differ."""
    given = [s.routed_experts for s in sequences if s.routed_experts is not None]
    if not given:
        return None
    if len(given) != len(sequences):
        raise ValueError("routed_experts: some sequences carry the generator's experts and others do not")
    shapes = {tuple(r.shape[1:]) for r in given}
    if len(shapes) != 1:
        raise ValueError(f"routed_experts: sequences disagree on [layers, top_k]: {sorted(shapes)}")
    layers, top_k = shapes.pop()
    out = filler_routing(rows, width, layers, top_k)
    for k, (seq, r) in enumerate(zip(sequences, given)):
        row, start = (0, starts[k]) if layout == "packed" else (k, 0)
        out[row, start : start + seq.length - 1] = r
    return out


def build_microbatches(
    batch: TrainBatch,
    token_budget: int,
    *,
    layout: Layout = "packed",
    strategy: Strategy = "greedy",
    pad_to_multiple: int = 1,
    pad_id: int = 0,
    segment_multiple: int = 1,
) -> list[Microbatch]:
    """Plan and collate a (per-rank) batch into microbatches (``segment_multiple``: see
    :func:`collate`; the plan counts each sequence at its rounded length)."""
    bins = plan_microbatches(
        [_round_up(n, segment_multiple) for n in batch.lengths],
        token_budget,
        layout=layout,
        strategy=strategy,
        pad_to_multiple=math.lcm(pad_to_multiple, segment_multiple),
    )
    return [
        collate(
            [batch.sequences[i] for i in b],
            b,
            layout=layout,
            pad_to_multiple=pad_to_multiple,
            pad_id=pad_id,
            segment_multiple=segment_multiple,
        )
        for b in bins
    ]


def filler_microbatch(layout: Layout, pad_to_multiple: int, segment_multiple: int = 1) -> Microbatch:
    """A microbatch that contributes exactly nothing (weight 0 everywhere): a data-parallel replica
    with fewer sequences than microbatches it must run still joins every collective with it."""
    seq = TrainSequence(
        tokens=torch.zeros(2, dtype=torch.long),
        prompt_length=1,
        behaviour_logprobs=torch.zeros(1),
        versions=torch.full((1,), -1),
        advantage=0.0,
        weight=0.0,
        group_id=-1,
    )
    return collate(
        [seq], [-1], layout=layout, pad_to_multiple=pad_to_multiple, segment_multiple=segment_multiple
    )


def pad_microbatch(mb: Microbatch, rows: int, width: int) -> Microbatch:
    """``mb`` grown to ``[rows, width]`` by padding that carries no loss: token 0, weight 0, no
    label mask. A packed row's tail padding stays one segment of its own in ``cu_seqlens``."""
    r, s = mb.tokens.shape
    if (r, s) == (rows, width):
        return mb

    def grow(t: torch.Tensor, value: int = 0) -> torch.Tensor:
        out = torch.full((rows, width), value, dtype=t.dtype)
        out[:r, :s] = t
        return out

    position_ids, cu_seqlens = grow(mb.position_ids), mb.cu_seqlens
    if mb.layout == "packed":
        bounds = mb.packed_cu_seqlens().tolist()
        tail = len(bounds) - 1 > len(mb.seq_lengths)  # the row ends in a padding segment of its own
        used = bounds[-2] if tail else bounds[-1]  # where the last sequence's segment ends
        bounds = bounds[:-1] + [width] if tail else bounds + [width]
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        position_ids[0, used:] = torch.arange(width - used)
    return dataclasses.replace(
        mb,
        tokens=grow(mb.tokens),
        position_ids=position_ids,
        labels=grow(mb.labels),
        loss_weights=grow(mb.loss_weights),
        advantages=grow(mb.advantages),
        behaviour_logprobs=grow(mb.behaviour_logprobs),
        versions=grow(mb.versions, -1),
        loss_mask=grow(mb.loss_mask),
        cu_seqlens=cu_seqlens,
        routed_experts=None if mb.routed_experts is None else _grow_routing(mb.routed_experts, rows, width),
        proximal_logprobs=None if mb.proximal_logprobs is None else grow(mb.proximal_logprobs),
    )


def _grow_routing(routed: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``routed [r, s, layers, top_k]`` grown to ``[rows, width, ...]`` with filler experts."""
    out = filler_routing(rows, width, routed.shape[2], routed.shape[3])
    out[: routed.shape[0], : routed.shape[1]] = routed
    return out


#: The microbatch's per-position tensors (``[R, S, ...]``): what moves to the device with it, and
#: what a context-parallel split cuts.
PER_POSITION_FIELDS = (
    "tokens",
    "position_ids",
    "labels",
    "loss_weights",
    "advantages",
    "behaviour_logprobs",
    "versions",
    "loss_mask",
    "routed_experts",
    "proximal_logprobs",
)


def split_for_context_parallel(mb: Microbatch, size: int, rank: int) -> Microbatch:
    """Context-parallel ``rank``'s share of the packed microbatch ``mb`` (of ``size`` ranks):
    chunks ``rank`` and ``2 size - 1 - rank`` of each of its segments, which must all be
    multiples of ``2 size`` tokens (``collate(..., segment_multiple=2 * size)``)."""
    if size == 1:
        return mb
    if mb.layout != "packed":
        raise ValueError("context parallelism splits packed rows only (batching.layout: packed)")
    bounds = mb.packed_cu_seqlens().tolist()
    if any(b % (2 * size) for b in bounds) or bounds[-1] != mb.tokens.shape[1]:
        raise ValueError(
            f"context parallelism {size}: every segment must be a multiple of {2 * size} tokens "
            f"(collate with segment_multiple={2 * size}), got bounds {bounds[:4]}..."
        )
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        c = (hi - lo) // (2 * size)
        for k in (rank, 2 * size - 1 - rank):
            parts.append(torch.arange(lo + k * c, lo + (k + 1) * c))
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    split = {
        name: getattr(mb, name)[:, index] for name in PER_POSITION_FIELDS if getattr(mb, name) is not None
    }
    return dataclasses.replace(mb, **split, cp_source=mb, cp_index=index)
