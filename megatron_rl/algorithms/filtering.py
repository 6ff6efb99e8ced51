"""Magistral's group filter: a group whose rewards are all equal carries no signal and is dropped.

With ``A_i = r_i - mean(r)`` such a group has all-zero advantages; keeping it only dilutes the
minibatch (and would shift the minibatch advantage statistics), so the batch builder removes it
before advantages are normalised.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.advantages import group_index
from megatron_rl.types import DROP_REASONS, FilterReport

__all__ = ["DROP_REASONS", "FilterReport", "filter_groups", "group_drop_reason"]


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
    flag = lambda t, g: None if t is None else bool(t[g])
    for g in torch.nonzero(group_equal).flatten().tolist():
        reason = _reason(flag(all_fmt_fail, g), flag(all_correct, g), flag(all_wrong, g))
        report.dropped[reason] += 1
    return keep, report


def group_drop_reason(
    rewards: list[float],
    *,
    tolerance: float = 0.0,
    correct: list[bool] | None = None,
    format_ok: list[bool] | None = None,
) -> str | None:
    """:func:`filter_groups` for one group, in plain Python (the RL loop filters each group as
    its last sample is scored: tensors for a dozen numbers cost more than the numbers): None
    when the group is kept, else the reason it is dropped. Same rule, same reasons."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if max(rewards) - min(rewards) > tolerance:  # float64, as filter_groups compares
        return None
    return _reason(
        None if format_ok is None else not any(format_ok),
        None if correct is None else all(correct),
        None if correct is None else not any(correct),
    )


def _reason(all_format_failed: bool | None, all_correct: bool | None, all_wrong: bool | None) -> str:
    """Why an equal-reward group is dropped (None: the flag was not given), first match wins."""
    if all_format_failed:
        return "all_format_failed"
    if all_correct:
        return "all_correct"
    if all_wrong:
        return "all_wrong"
    return "equal_reward"
