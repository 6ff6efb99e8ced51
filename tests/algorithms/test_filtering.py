import random

import pytest
import torch

from megatron_rl.algorithms.filtering import filter_groups, group_drop_reason


def test_equal_groups_dropped_with_reasons():
    #            g0 mixed   | g1 all correct | g2 all wrong | g3 format failed | g4 equal, mixed
    rewards = torch.tensor([1.0, 0.1, 1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    correct = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    format_ok = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    keep, report = filter_groups(rewards, groups, correct=correct, format_ok=format_ok)
    assert keep.tolist() == [True, True] + [False] * 8
    assert report.groups_total == 5 and report.groups_kept == 1 and report.groups_dropped == 4
    assert report.dropped == {"all_format_failed": 1, "all_correct": 1, "all_wrong": 1, "equal_reward": 1}
    assert report.completions_kept == 2 and report.completions_dropped == 8
    m = report.as_metrics()
    assert m["filter/dropped_all_correct"] == 1 and m["filter/groups_kept"] == 1


def test_tolerance():
    rewards = torch.tensor([1.0, 1.05, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    keep, report = filter_groups(rewards, groups)
    assert keep.all()
    keep, report = filter_groups(rewards, groups, tolerance=0.1)
    assert keep.tolist() == [False, False, True, True]
    assert report.dropped["equal_reward"] == 1  # no correctness flags given
    with pytest.raises(ValueError, match="tolerance"):
        filter_groups(rewards, groups, tolerance=-1)


def test_single_completion_group_is_dropped_and_reports_merge():
    keep, r1 = filter_groups(torch.tensor([1.0]), torch.tensor([0]))
    assert not keep.any() and r1.groups_dropped == 1
    _, r2 = filter_groups(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    total = r1.merge(r2)
    assert total.groups_total == 2 and total.groups_kept == 1 and total.groups_dropped == 1


def test_one_group_in_plain_python_agrees_with_the_tensor_filter():
    """The RL loop filters each group as it completes with group_drop_reason; the batch builder
    with filter_groups: the same keep/drop and the same reason on every kind of group."""
    rng = random.Random(0)
    cases = [
        ([0.1, 0.1, 0.1], [False] * 3, [False] * 3),  # all format failed
        ([1.0, 1.0], [True, True], [True, True]),  # all correct
        ([0.1, 0.1], [False, False], [True, True]),  # all wrong
        ([0.5, 0.5], [True, False], [True, True]),  # equal rewards, mixed outcomes
        ([0.5, 0.5 + 1e-12], [True, False], [True, True]),  # differ by a hair: kept at tolerance 0
    ]
    for _ in range(300):
        n = rng.randint(1, 6)
        cases.append(
            (
                [rng.choice([0.0, 0.1, 0.9, 1.0, 0.95]) for _ in range(n)],
                [rng.random() < 0.5 for _ in range(n)],
                [rng.random() < 0.8 for _ in range(n)],
            )
        )
    for tolerance in (0.0, 0.05):
        for rewards, correct, fmt in cases:
            keep, report = filter_groups(
                torch.tensor(rewards, dtype=torch.float64),
                torch.zeros(len(rewards), dtype=torch.long),
                tolerance=tolerance,
                correct=torch.tensor(correct),
                format_ok=torch.tensor(fmt),
            )
            got = group_drop_reason(rewards, tolerance=tolerance, correct=correct, format_ok=fmt)
            want = None if bool(keep.all()) else next(r for r, n in report.dropped.items() if n)
            assert got == want, (rewards, correct, fmt, tolerance)
    with pytest.raises(ValueError, match="tolerance"):
        group_drop_reason([1.0], tolerance=-1.0)
