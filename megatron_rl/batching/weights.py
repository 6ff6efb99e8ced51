"""Per-token loss weights: the loss normalisation, fixed before the batch is split.

The GRPO loss of a minibatch is ``sum_t weight_t * loss_t`` over every completion token. Putting
the normaliser in the weight (instead of dividing inside each microbatch) makes the loss, and so
the gradient, independent of how sequences are grouped into microbatches, pipeline stages or
data-parallel ranks: a microbatch contributes a plain partial sum.

Modes, for a minibatch of ``n_groups`` kept groups and ``N`` completions of lengths ``|o_i|``:

- ``group`` (Magistral): ``1 / (n_groups * sum_{j in group(i)} |o_j|)`` -- each group's token
  losses are summed, divided by the group's token count, and the groups are averaged.
- ``token``: ``1 / sum_j |o_j|`` -- a token mean over the minibatch.
- ``sequence``: ``1 / (N * |o_i|)`` -- a mean per sequence, then over sequences (original GRPO).

Data parallelism: weights are computed over the *global* minibatch, so the per-rank losses add up
to the minibatch loss. A trainer whose DDP averages gradients over ``dp`` ranks must scale its
loss by ``dp`` (or sum instead of average) to keep this exact.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_rl.algorithms.advantages import group_index

LossNorm = Literal["group", "token", "sequence"]

__all__ = ["LossNorm", "loss_token_weights"]


def loss_token_weights(
    completion_lengths: torch.Tensor, group_ids: torch.Tensor, mode: LossNorm = "group"
) -> torch.Tensor:
    """Weight of each completion token, one value per sequence.

    Args:
        completion_lengths: ``[N]`` number of loss tokens of each completion (>= 1).
        group_ids: ``[N]`` prompt group of each completion.
        mode: ``group`` | ``token`` | ``sequence`` (see module docstring).
    Returns:
        ``[N]`` float64 weight applied to every token of completion ``i``. The weights of all
        tokens sum to 1 in every mode.
    """
    lengths = completion_lengths.to(torch.float64)
    if lengths.numel() == 0:
        return lengths
    if bool((lengths < 1).any()):
        raise ValueError("every completion needs at least one loss token")
    if mode == "token":
        return torch.full_like(lengths, 1.0 / float(lengths.sum()))
    if mode == "sequence":
        return 1.0 / (lengths.numel() * lengths)
    if mode == "group":
        index, n_groups = group_index(group_ids)
        group_tokens = torch.zeros(n_groups, dtype=torch.float64, device=lengths.device).index_add_(
            0, index, lengths
        )
        return 1.0 / (n_groups * group_tokens[index])
    raise ValueError(f"loss normalisation must be 'group', 'token' or 'sequence', got {mode!r}")
