"""Assignment of a minibatch's sequences to data-parallel ranks.

``permutation`` (Magistral): a pre-set, seeded permutation decides the rank of each position in
the batch, so every rank receives the same number of sequences (+-1) whatever their lengths.
``balanced``: longest-processing-time greedy on token counts -- each sequence, longest first, goes
to the rank with the fewest tokens among those still under the per-rank sequence cap -- which
evens out the work per rank when lengths are long-tailed.

Loss weights are global (``batching/weights.py``), so the assignment changes the speed, never the
gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

DPAssignment = Literal["permutation", "balanced"]

__all__ = ["DPAssignment", "assign_data_parallel", "dp_imbalance"]


def assign_data_parallel(
    lengths: Sequence[int], dp_size: int, *, mode: DPAssignment = "permutation", seed: int = 0
) -> list[list[int]]:
    """Indices of the sequences each of ``dp_size`` ranks trains on (sorted within a rank)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    n = len(lengths)
    if mode == "permutation":
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n, generator=gen).tolist()
        ranks: list[list[int]] = [[] for _ in range(dp_size)]
        for position, i in enumerate(perm):
            ranks[position % dp_size].append(i)
        return [sorted(r) for r in ranks]
    if mode == "balanced":
        cap = math.ceil(n / dp_size)
        ranks = [[] for _ in range(dp_size)]
        tokens = [0] * dp_size
        for i in sorted(range(n), key=lambda i: -lengths[i]):
            r = min((r for r in range(dp_size) if len(ranks[r]) < cap), key=lambda r: tokens[r])
            ranks[r].append(i)
            tokens[r] += lengths[i]
        return [sorted(r) for r in ranks]
    raise ValueError(f"dp assignment must be 'permutation' or 'balanced', got {mode!r}")


def dp_imbalance(lengths: Sequence[int], assignment: list[list[int]]) -> float:
    """Max over mean of the tokens per rank (1.0 = perfectly even)."""
    per_rank = [sum(lengths[i] for i in r) for r in assignment]
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
