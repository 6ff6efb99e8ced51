"""The GRPO math as pure tensor functions: advantages, group filter, log-probs/entropy (plain and
vocab-parallel) and the clipped loss with its metrics. No globals, no config objects inside."""

from megatron_rl.algorithms.advantages import compute_advantages, group_advantages, minibatch_normalize
from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.algorithms.filtering import FilterReport, filter_groups
from megatron_rl.algorithms.logprobs import naive_token_logprobs, token_logprobs
from megatron_rl.algorithms.loss import finalize_loss_metrics, grpo_loss, reduce_loss_metrics

__all__ = [
    "FilterReport",
    "GRPOConfig",
    "compute_advantages",
    "filter_groups",
    "finalize_loss_metrics",
    "group_advantages",
    "grpo_loss",
    "minibatch_normalize",
    "naive_token_logprobs",
    "reduce_loss_metrics",
    "token_logprobs",
]
