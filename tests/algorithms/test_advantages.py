import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms.advantages import compute_advantages, group_advantages, minibatch_normalize

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])  # arbitrary, non-contiguous ids


def test_group_centering_by_hand():
    adv = group_advantages(REWARDS, GROUPS, mode="center")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))


def test_group_std_normalisation_by_hand():
    adv = group_advantages(REWARDS, GROUPS, mode="center_std", eps=0.0)
    s1 = math.sqrt((0.75**2 + 3 * 0.25**2) / 4)  # population std of group 7
    expected = torch.tensor([0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, 1, 1, -1, -1])
    torch.testing.assert_close(adv, expected)


def test_minibatch_normalisation_by_hand():
    adv = compute_advantages(REWARDS, GROUPS, eps=0.0)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    std = math.sqrt((0.75**2 + 3 * 0.25**2 + 4 * 0.5**2) / 8)  # mean is 0 already
    torch.testing.assert_close(adv, centred / std)


def test_no_minibatch_normalisation_is_plain_centering():
    adv = compute_advantages(REWARDS, GROUPS, minibatch_norm=False)
    torch.testing.assert_close(adv, group_advantages(REWARDS, GROUPS))


def test_mask_excludes_from_statistics_and_zeroes():
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([True, True, False, False])
    adv = compute_advantages(rewards, groups, mask=mask, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert minibatch_normalize(torch.ones(3), mask=torch.zeros(3, dtype=torch.bool)).eq(0).all()


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="center"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), mode="bogus")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-2, 2, allow_nan=False), min_size=2, max_size=8), min_size=1, max_size=10))
def test_minibatch_normalised_advantages_have_mean_0_std_1(groups):
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    ids = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    centred = group_advantages(rewards, ids)
    assume(centred.std(unbiased=False) > 1e-3)
    adv = compute_advantages(rewards, ids, eps=1e-12)
    assert abs(float(adv.mean())) < 1e-9
    assert abs(float(adv.std(unbiased=False)) - 1.0) < 1e-6
    # Centring is per group: each group's centred advantages sum to zero.
    for i in range(len(groups)):
        assert abs(float(centred[ids == i].sum())) < 1e-9


def test_minibatch_standardisation_is_the_papers_formula_exactly_at_the_default_eps():
    """(A - mean) / std, not / (std + eps): the default eps changes nothing on a real batch and
    only guards a batch whose advantages are all equal (which then gives zeros, not NaN)."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(256, generator=g, dtype=torch.float64) * 0.05
    paper = (adv - adv.mean()) / adv.std(unbiased=False)
    # Equal to rounding (1e-12 relative); "/ (std + eps)" would be off by eps / std = 2e-5.
    torch.testing.assert_close(minibatch_normalize(adv), paper, rtol=1e-12, atol=0.0)
    flat = minibatch_normalize(torch.full((16,), 0.3, dtype=torch.float64))
    assert torch.isfinite(flat).all() and torch.equal(flat, torch.zeros(16, dtype=torch.float64))
