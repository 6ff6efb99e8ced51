import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms.loss import finalize_loss_metrics, grpo_loss, reduce_loss_metrics


def _case(ratios, advantages, weights=None):
    behaviour = torch.tensor([-1.0] * len(ratios))
    logp = (behaviour + torch.log(torch.tensor(ratios))).requires_grad_()
    adv = torch.tensor(advantages)
    w = torch.ones(len(ratios)) if weights is None else torch.tensor(weights)
    return logp, behaviour, adv, w


def test_clipped_surrogate_by_hand():
    # ratio 1.5, A=+1: clipped at 1.28 -> loss -1.28, no gradient
    # ratio 0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped low, no gradient
    # ratio 1.5, A=-1: min(-1.5, -1.28) = -1.5 -> loss 1.5, gradient flows
    # ratio 0.5, A=+1: min(0.5, 0.8) = 0.5 -> loss -0.5, gradient flows
    logp, behaviour, adv, w = _case([1.5, 0.5, 1.5, 0.5], [1.0, -1.0, -1.0, 1.0])
    loss, metrics = grpo_loss(logp, behaviour, adv, w, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28 + 0.8 + 1.5 - 0.5, abs=1e-6)
    loss.backward()
    # d/dlogp of -rho*A is -rho*A where unclipped.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, 1.5, -0.5]))
    m = finalize_loss_metrics(metrics)
    assert m["clip_low_frac"] == 0.25 and m["clip_high_frac"] == 0.25
    assert m["ratio_mean"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.5)
    expected_kl = sum((r - 1) - math.log(r) for r in [1.5, 0.5, 1.5, 0.5]) / 4
    assert m["approx_kl_mean"] == pytest.approx(expected_kl, rel=1e-5)
    assert m["tokens"] == 4


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0 is inside [0.8, 1.28] (Clip-Higher) but outside symmetric [0.8, 1.2].
    logp, behaviour, adv, w = _case([1.25], [1.0])
    grpo_loss(logp, behaviour, adv, w, eps_low=0.2, eps_high=0.28)[0].backward()
    assert logp.grad.item() == pytest.approx(-1.25)
    logp.grad = None
    grpo_loss(logp, behaviour, adv, w, eps_low=0.2, eps_high=0.2)[0].backward()
    assert logp.grad.item() == 0.0
    # The lower side stays at 1 - eps_low whatever eps_high is: ratio 0.78 with A < 0 is clipped.
    logp, behaviour, adv, w = _case([0.78], [-1.0])
    loss, m = grpo_loss(logp, behaviour, adv, w, eps_low=0.2, eps_high=10.0)
    loss.backward()
    assert logp.grad.item() == 0.0 and m["clip_low_sum"].item() == 1


def test_weights_scale_and_zero_weight_tokens_contribute_nothing():
    logp, behaviour, adv, _ = _case([1.0, 1.0, 1.0], [2.0, -1.0, 5.0])
    w = torch.tensor([0.25, 0.5, 0.0])
    # A masked token may hold garbage (padding): it must not leak into loss or gradient.
    behaviour = behaviour.clone()
    behaviour[2] = float("nan")
    loss, metrics = grpo_loss(logp, behaviour, adv, w)
    assert loss.item() == pytest.approx(-(0.25 * 2.0 + 0.5 * -1.0))
    loss.backward()
    assert logp.grad[2].item() == 0.0 and torch.isfinite(logp.grad).all()
    assert metrics["tokens"].item() == 2


def test_kl_penalty_optional():
    logp, behaviour, adv, w = _case([1.0, 1.0], [1.0, -1.0])
    base, _ = grpo_loss(logp, behaviour, adv, w)
    same, _ = grpo_loss(logp, behaviour, adv, w, kl_coef=0.5, ref_logp=logp.detach())
    assert same.item() == pytest.approx(base.item())
    ref = logp.detach() - 1.0  # k3(x=-1) = e^-1 + 1 - 1
    shifted, _ = grpo_loss(logp, behaviour, adv, w, kl_coef=0.5, ref_logp=ref)
    assert shifted.item() == pytest.approx(base.item() + 0.5 * 2 * math.exp(-1.0), rel=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, behaviour, adv, w, kl_coef=0.1)


def test_extreme_ratios_stay_finite():
    logp = torch.tensor([200.0, -200.0], requires_grad=True)
    loss, _ = grpo_loss(logp, torch.zeros(2), torch.tensor([-1.0, 1.0]), torch.ones(2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_bad_arguments():
    t = torch.zeros(3)
    with pytest.raises(ValueError, match="eps_low"):
        grpo_loss(t, t, t, t, eps_low=1.0)
    with pytest.raises(ValueError, match="weights shape"):
        grpo_loss(t, t, t, torch.zeros(2))


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 64), cuts=st.lists(st.integers(0, 64), max_size=8), seed=st.integers(0, 10_000))
def test_loss_and_gradient_identical_whole_or_split(n, cuts, seed):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(n, generator=g) * 0.3 - 2).requires_grad_()
    behaviour = torch.randn(n, generator=g) * 0.3 - 2
    adv = torch.randn(n, generator=g)
    weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    weights = weights / weights.sum().clamp(min=1e-6)  # as built: token weights sum to 1
    whole, whole_m = grpo_loss(logp, behaviour, adv, weights)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    parts, metrics = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        loss, m = grpo_loss(logp[lo:hi], behaviour[lo:hi], adv[lo:hi], weights[lo:hi])
        parts.append(loss)
        metrics.append(m)
    split = torch.stack(parts).sum()
    (split_grad,) = torch.autograd.grad(split, logp)
    assert abs(split.item() - whole.item()) <= 1e-6
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-6, rtol=0)
    reduced = finalize_loss_metrics(reduce_loss_metrics(metrics))
    for k, v in finalize_loss_metrics(whole_m).items():
        assert reduced[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
