import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms.loss import decoupled_loss, finalize_loss_metrics, grpo_loss, reduce_loss_metrics


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


# -- decoupled PPO (algorithm.objective: decoupled) -------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    eps=st.sampled_from([(0.2, 0.28), (0.1, 0.1), (0.3, 0.5)]),
    cap=st.sampled_from([0.0, 1.5, 5.0]),
)
def test_decoupled_equals_the_paper_loss_when_proximal_is_behaviour(n, seed, eps, cap):
    """With the proximal policy equal to the behaviour policy the decoupled objective *is* the
    paper's: the same loss, gradient and metrics, bit for bit (the weights are multiplied by 1.0)."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -3.0 * torch.rand(n, generator=g)
    logp = (behaviour + 0.5 * torch.randn(n, generator=g)).requires_grad_()
    adv = torch.randn(n, generator=g)
    w = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    entropy = torch.rand(n, generator=g)
    loss, metrics = grpo_loss(logp, behaviour, adv, w, eps_low=eps[0], eps_high=eps[1], entropy=entropy)
    (grad,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    loss2, metrics2 = decoupled_loss(
        logp2,
        behaviour.clone(),
        behaviour,
        adv,
        w,
        eps_low=eps[0],
        eps_high=eps[1],
        weight_cap=cap,
        entropy=entropy,
    )
    (grad2,) = torch.autograd.grad(loss2, logp2)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad)
    for k, v in metrics.items():
        assert torch.equal(metrics2[k], v), k
    assert float(metrics2["behaviour_weight_sum"]) == float(metrics["tokens"])  # every factor is 1
    assert float(metrics2["behaviour_capped_sum"]) == 0.0


def test_decoupled_clips_against_the_proximal_policy_and_weights_by_behaviour():
    """By hand: the ratio is new / proximal, the clip bounds it, and proximal / behaviour scales
    the token (no gradient through it)."""
    behaviour = torch.tensor([-2.0, -2.0, -1.0])
    proximal = behaviour + torch.log(torch.tensor([2.0, 0.5, 1.0]))  # factors 2, 0.5, 1
    # new / proximal: 1.5 (A>0: clipped at 1.28), 1.1 (A<0: unclipped), 0.5 (A<0: clipped low)
    logp = (proximal + torch.log(torch.tensor([1.5, 1.1, 0.5]))).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -1.0])
    w = torch.tensor([0.1, 0.2, 0.3])
    loss, metrics = decoupled_loss(logp, proximal, behaviour, adv, w, eps_low=0.2, eps_high=0.28)
    want = 0.1 * 2.0 * -1.28 + 0.2 * 0.5 * 1.1 + 0.3 * 1.0 * 0.8
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    # d/dlogp of -w f rho A = -w f rho A where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.2 * 0.5 * 1.1, 0.0]))
    m = finalize_loss_metrics(metrics)
    assert m["behaviour_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert m["clip_high_frac"] == pytest.approx(1 / 3) and m["clip_low_frac"] == pytest.approx(1 / 3)
    # The paper's loss on the same tokens clips against the behaviour policy instead: token 0's
    # ratio is 3 there, token 1's 0.55 (clipped low with A<0) -- a different objective.
    paper, _ = grpo_loss(logp.detach(), behaviour, adv, w)
    assert paper.item() != pytest.approx(loss.item())


def test_decoupled_cap_leaves_out_tokens_too_far_off_policy():
    behaviour = torch.zeros(4) - 1.0
    proximal = behaviour + torch.log(torch.tensor([1.0, 4.0, 6.0, 100.0]))
    logp = proximal.clone().requires_grad_()
    adv = torch.ones(4)
    w = torch.tensor([0.25, 0.25, 0.25, 0.0])  # the last token carries no loss at all
    loss, metrics = decoupled_loss(logp, proximal, behaviour, adv, w, weight_cap=5.0)
    assert loss.item() == pytest.approx(-(0.25 * 1.0 + 0.25 * 4.0))  # factor 6 > 5: left out
    assert float(metrics["behaviour_capped_sum"]) == 1.0 and float(metrics["tokens"]) == 2.0
    loss.backward()
    assert logp.grad[2] == 0.0 and logp.grad[3] == 0.0
    uncapped, _ = decoupled_loss(logp.detach(), proximal, behaviour, adv, w, weight_cap=0.0)
    assert uncapped.item() == pytest.approx(-(0.25 + 1.0 + 1.5))
    with pytest.raises(ValueError, match="proximal_logp shape"):
        decoupled_loss(logp, proximal[:2], behaviour, adv, w)


def test_decoupled_objective_config_is_checked():
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.config import ConfigFieldError

    assert GRPOConfig().objective == "magistral"
    with pytest.raises(ConfigFieldError, match="objective"):
        GRPOConfig(objective="areal")
    with pytest.raises(ConfigFieldError, match="behaviour_weight_cap"):
        GRPOConfig(objective="decoupled", behaviour_weight_cap=0.9)
