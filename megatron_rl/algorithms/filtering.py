"""Magistral's group filter: a group whose rewards are all equal carries no signal and is dropped.

With ``A_i = r_i - mean(r)`` such a group has all-zero advantages; keeping it only dilutes the
minibatch (and would shift the minibatch advantage statistics), so the batch builder removes it
before advantages are normalised.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.advantages import group_index
from megatron_rl.types import DROP_REASONS, FilterReport

__all__ = ["DROP_REASONS", "FilterReport", "filter_groups"]


def filter_groups(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    tolerance: float = 0.0,
    correct: torch.Tensor | None = None,
    format_ok: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FilterReport]:
    """Drop groups whose rewards are all equal.

    Args:
        rewards: ``[N]`` reward per completion.
        group_ids: ``[N]`` group (prompt) id per completion.
        tolerance: a group is "equal" when ``max(r) - min(r) <= tolerance``; ``0.0`` is the exact
            test of the paper (``r_m != r_n`` for some pair keeps the group).
        correct: optional ``[N]`` bool, whether the answer was correct; used only for the reason.
        format_ok: optional ``[N]`` bool, whether the format check passed; used only for the reason.
    Returns:
        ``keep`` ``[N]`` bool (True for completions of kept groups) and a :class:`FilterReport`.
        A dropped group's reason is ``all_format_failed`` if no completion passed the format check,
        else ``all_correct`` / ``all_wrong`` when every completion was correct / wrong, else
        ``equal_reward`` (equal rewards for mixed outcomes, or no outcome flags given).
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    index, n_groups = group_index(group_ids)
    r = rewards.double()
    gmax = torch.full((n_groups,), -float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, index, r, reduce="amax"
    )
    gmin = torch.full((n_groups,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, index, r, reduce="amin"
    )
    group_equal = (gmax - gmin) <= tolerance
    keep = ~group_equal[index]

    def _all(flags: torch.Tensor | None, value: bool) -> torch.Tensor | None:
        if flags is None:
            return None
        hit = (flags.bool() == value).long()
        count = torch.zeros(n_groups, dtype=torch.long, device=r.device).index_add_(0, index, hit)
        size = torch.zeros(n_groups, dtype=torch.long, device=r.device).index_add_(
            0, index, torch.ones_like(hit)
        )
        return count == size

    all_fmt_fail = _all(format_ok, False)
    all_correct = _all(correct, True)
    all_wrong = _all(correct, False)
    report = FilterReport(
        groups_total=n_groups,
        groups_kept=int((~group_equal).sum()),
        completions_kept=int(keep.sum()),
        completions_dropped=int((~keep).sum()),
    )
    for g in torch.nonzero(group_equal).flatten().tolist():
        if all_fmt_fail is not None and all_fmt_fail[g]:
            reason = "all_format_failed"
        elif all_correct is not None and all_correct[g]:
            reason = "all_correct"
        elif all_wrong is not None and all_wrong[g]:
            reason = "all_wrong"
        else:
            reason = "equal_reward"
        report.dropped[reason] += 1
    return keep, report
