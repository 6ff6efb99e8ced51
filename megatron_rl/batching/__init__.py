"""From scored groups to microbatches: batch builder, per-token loss weights, collation and
data-parallel assignment."""

from megatron_rl.batching.builder import build_train_batch
from megatron_rl.batching.collate import (
    CollationStats,
    Microbatch,
    build_microbatches,
    collate,
    collation_stats,
    plan_microbatches,
)
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.batching.dp import assign_data_parallel, dp_imbalance
from megatron_rl.batching.weights import loss_token_weights

__all__ = [
    "BatchingConfig",
    "CollationStats",
    "Microbatch",
    "assign_data_parallel",
    "build_microbatches",
    "build_train_batch",
    "collate",
    "collation_stats",
    "dp_imbalance",
    "loss_token_weights",
    "plan_microbatches",
]
