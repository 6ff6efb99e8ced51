"""Configuration of microbatch collation and data-parallel assignment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import check_range


@dataclass(kw_only=True)
class BatchingConfig:
    """How a minibatch is cut into microbatches and spread over data-parallel ranks."""

    # tokens per microbatch (packed) or rows x longest row (padded), per rank: under context
    # parallelism a rank holds 1/CP of each micro-batch, so micro-batches hold CP x this
    token_budget: int = 16384
    layout: Literal["packed", "padded"] = "packed"  # packed rows with cu_seqlens, or padded rows
    strategy: Literal["greedy", "uniform"] = "greedy"  # first-fit decreasing, or arrival-order fill
    pad_to_multiple: int = 1  # round each packed row / padded row length up to this (TP/SP, TE)
    dp_assignment: Literal["permutation", "balanced"] = "permutation"  # paper: pre-set permutation
    seed: int = 0  # seed of the DP permutation

    def __post_init__(self):
        check_range("token_budget", self.token_budget, low=1)
        check_range("pad_to_multiple", self.pad_to_multiple, low=1)
