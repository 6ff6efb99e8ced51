"""Advantages for GRPO as Magistral computes them.

For a prompt with G completions and rewards r_1..r_G the group step gives
``A_i = r_i - mean_group(r)`` (no division by the group std). The minibatch step then
standardises over every completion of the minibatch: ``A <- (A - mean(A)) / max(std(A), eps)``
(the paper's ``(A - mean) / std`` exactly whenever ``std > eps``; ``eps`` only guards 0).
Two ablations are selectable: the original GRPO ``(r - mu) / sigma`` per group, and no minibatch
normalisation at all.

All functions are pure: they take ``[N]`` tensors indexed by completion and return ``[N]``.
"""

from __future__ import annotations

from typing import Literal

import torch

GroupNorm = Literal["center", "center_std"]

__all__ = ["GroupNorm", "compute_advantages", "group_advantages", "group_index", "minibatch_normalize"]


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids ``[N]`` to dense indices ``[N]`` in ``0..n_groups-1``."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D [N], got shape {tuple(group_ids.shape)}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_stats(
    values: torch.Tensor, index: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and population std of ``values`` ``[N]``; returns ``[n_groups]`` each."""
    counts = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, torch.ones_like(values)
    )
    sums = torch.zeros_like(counts).index_add_(0, index, values)
    mean = sums / counts
    centred = values - mean[index]
    var = torch.zeros_like(counts).index_add_(0, index, centred * centred) / counts
    return mean, var.sqrt()


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, mode: GroupNorm = "center", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[N]`` scalar reward per completion.
        group_ids: ``[N]`` id of the prompt group each completion belongs to (any integers).
        mode: ``"center"`` gives ``r - mean_group(r)`` (Magistral); ``"center_std"`` gives
            ``(r - mean) / (std + eps)`` per group (original GRPO), std being the population std.
    Returns:
        ``[N]`` advantages, same dtype as ``rewards``.
    """
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} differ")
    rewards = rewards.to(torch.float64) if rewards.dtype == torch.float64 else rewards.float()
    index, n_groups = group_index(group_ids)
    mean, std = _group_stats(rewards, index, n_groups)
    adv = rewards - mean[index]
    if mode == "center":
        return adv
    if mode == "center_std":
        return adv / (std[index] + eps)
    raise ValueError(f"group normalisation mode must be 'center' or 'center_std', got {mode!r}")


def minibatch_normalize(
    advantages: torch.Tensor, *, eps: float = 1e-6, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Standardise ``[N]`` advantages over the minibatch: ``(A - mean) / max(std, eps)``.

    ``std`` is the population std, so the result has std exactly 1 whenever ``std > eps``
    (``std + eps`` would bias every batch by ~``eps / std``). Entries where
    ``mask`` is False (for example completions of dropped groups) neither enter the statistics nor
    receive a value: they come back as 0.
    """
    if mask is None:
        mask = torch.ones_like(advantages, dtype=torch.bool)
    n = mask.sum()
    if int(n) == 0:
        return torch.zeros_like(advantages)
    kept = torch.where(mask, advantages, torch.zeros_like(advantages))
    mean = kept.sum() / n
    var = torch.where(mask, (advantages - mean) ** 2, torch.zeros_like(advantages)).sum() / n
    out = (advantages - mean) / var.sqrt().clamp_min(eps)
    return torch.where(mask, out, torch.zeros_like(out))


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    group_norm: GroupNorm = "center",
    minibatch_norm: bool = True,
    eps: float = 1e-6,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group step then (optionally) minibatch step; ``[N]`` in, ``[N]`` out.

    Pass ``mask`` (``[N]`` bool, False for completions of filtered groups) so that dropped groups
    neither shift the minibatch statistics nor get a non-zero advantage.
    """
    adv = group_advantages(rewards, group_ids, mode=group_norm, eps=eps)
    if minibatch_norm:
        return minibatch_normalize(adv, eps=eps, mask=mask)
    if mask is not None:
        adv = torch.where(mask, adv, torch.zeros_like(adv))
    return adv
