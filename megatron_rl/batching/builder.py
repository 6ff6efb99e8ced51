"""The batch builder: scored groups of one minibatch -> :class:`TrainBatch`.

Order matters and follows the paper: drop groups with equal rewards first, then compute the
group-centred advantages and standardise them over the kept completions of the minibatch only,
then fix the per-token loss weights over the kept completions (so dropped groups contribute exactly
nothing, not even to the normalisers).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.algorithms.filtering import filter_groups
from megatron_rl.batching.weights import loss_token_weights
from megatron_rl.types import Group, TrainBatch, TrainSequence

__all__ = ["build_train_batch"]


def _flags(groups: list[Group], attr: str) -> torch.Tensor | None:
    values = [getattr(sc, attr) for g in groups for sc in g.completions]
    return None if any(v is None for v in values) else torch.tensor(values, dtype=torch.bool)


def build_train_batch(groups: list[Group], cfg: GRPOConfig) -> TrainBatch:
    """Filter, compute advantages and loss weights for one minibatch of groups."""
    scored = [(gi, g, sc) for gi, g in enumerate(groups) for sc in g.completions]
    if not scored:
        return TrainBatch(sequences=[])
    rewards = torch.tensor([sc.reward for _, _, sc in scored], dtype=torch.float64)
    group_ids = torch.tensor([gi for gi, _, _ in scored], dtype=torch.long)
    keep, report = filter_groups(
        rewards,
        group_ids,
        tolerance=cfg.filter_tolerance,
        correct=_flags(groups, "correct"),
        format_ok=_flags(groups, "format_ok"),
    )
    adv = compute_advantages(
        rewards,
        group_ids,
        group_norm=cfg.group_norm,
        minibatch_norm=cfg.minibatch_norm,
        eps=cfg.adv_eps,
        mask=keep,
    )
    # A completion without a sampled token (a trajectory whose environment failed at reset, a
    # request that timed out twice) counts in its group's advantages but has nothing to train.
    kept = [i for i in torch.nonzero(keep).flatten().tolist() if scored[i][2].completion.model_tokens > 0]
    # The normaliser counts the tokens that carry loss: a multi-turn trajectory's model tokens only.
    lengths = torch.tensor([scored[i][2].completion.model_tokens for i in kept], dtype=torch.long)
    weights = loss_token_weights(lengths, group_ids[kept], cfg.loss_norm) if kept else torch.empty(0)
    sequences = []
    for k, i in enumerate(kept):
        gi, group, sc = scored[i]
        c = sc.completion
        prompt = group.prompt.token_ids if c.prompt_ids is None else c.prompt_ids
        sequences.append(
            TrainSequence(
                tokens=torch.tensor(list(prompt) + list(c.token_ids), dtype=torch.long),
                prompt_length=len(prompt),
                behaviour_logprobs=torch.tensor(c.logprobs, dtype=torch.float32),
                versions=torch.tensor(c.versions, dtype=torch.long),
                advantage=float(adv[i]),
                weight=float(weights[k]),
                group_id=gi,
                reward=float(rewards[i]),
                routed_experts=c.routed_experts,
                loss_mask=None if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.bool),
            )
        )
    return TrainBatch(sequences=sequences, filter_report=report)
