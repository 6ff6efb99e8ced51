"""The GRPO policy loss with Clip-Higher, as a weighted sum over tokens.

Per token ``t`` of completion ``i``::

    rho_t  = exp(logp_new_t - logp_behaviour_t)
    loss_t = -min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)

``logp_behaviour_t`` is the log-prob the generator recorded for that very token, so a completion
generated across several policy versions is corrected token by token.

The loss is ``sum_t weight_t * loss_t``. The normalisation (Magistral: divide each group's token
sum by that group's token count and average over groups) is carried entirely by ``weight_t``,
computed once per minibatch by :func:`megatron_rl.batching.weights.loss_token_weights` before any
split. The loss of a minibatch is therefore the plain sum of its microbatches' losses, whatever
the split into microbatches, pipeline stages or data-parallel ranks.

**Decoupled PPO** (AReaL, Fu et al. 2025; ``algorithm.objective: decoupled``) separates the two
jobs the behaviour log-prob does above -- the trust region and the off-policy correction::

    w_t    = exp(logp_proximal_t - logp_behaviour_t)      (no gradient; tokens with w_t > cap dropped)
    rho_t  = exp(logp_new_t - logp_proximal_t)
    loss_t = -w_t * min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)

where the proximal policy is the trainer's weights at the start of the step. The clip then bounds
how far one step moves the policy from where it *is*, however old the generator's weights were,
and ``w_t`` corrects for sampling from the old ones. When proximal and behaviour coincide
(``w_t = 1``) it is :func:`grpo_loss` exactly: :func:`decoupled_loss` is that function with the
proximal log-probs as the reference and the weights multiplied by ``w_t``.

Metrics come back as sums (``*_sum``), maxima (``*_max``) and a token count, so microbatches and
ranks can be reduced with one sum / max each; :func:`finalize_loss_metrics` turns them into means.
"""

from __future__ import annotations

import torch

__all__ = ["DECOUPLED_METRICS", "decoupled_loss", "finalize_loss_metrics", "grpo_loss", "reduce_loss_metrics"]

# exp() of a log-ratio above ~88 overflows fp32. A ratio of e^20 is already far outside any clip
# range, so clamping the log-ratio there changes no clipped term and keeps gradients finite.
_MAX_LOG_RATIO = 20.0


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO clipped surrogate, weighted per token.

    Args:
        logp: ``[T]`` (or any shape, all inputs alike) log-prob of each taken token under the
            policy being trained; differentiable.
        behaviour_logp: ``[T]`` log-prob recorded at generation for the same token.
        advantages: ``[T]`` the completion's advantage repeated on each of its tokens.
        weights: ``[T]`` per-token loss weight (normalisation); 0 for prompt, padding and tokens
            of dropped groups. Tokens with weight 0 contribute exactly nothing and are not counted
            in the metrics.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (Clip-Higher: eps_high > eps_low).
        kl_coef: coefficient of an optional KL penalty to a reference policy (default 0: none).
        ref_logp: ``[T]`` reference log-probs; required when ``kl_coef > 0``.
        entropy: ``[T]`` optional per-token entropy, only for the metrics.
    Returns:
        ``(loss, metrics)``: scalar loss and a dict of scalar tensors (see module docstring).
    """
    if eps_low < 0 or eps_low >= 1:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if eps_high < 0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if kl_coef and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (reference-model log-probs)")
    for name, t in (("behaviour_logp", behaviour_logp), ("advantages", advantages), ("weights", weights)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from logp {tuple(logp.shape)}")

    mask = weights != 0
    log_ratio = (logp - behaviour_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if kl_coef and ref_logp is not None:  # ref_logp is set whenever kl_coef is (checked above)
        # k3 estimator of KL(pi_theta || pi_ref) on samples of pi_theta: e^x - x - 1, x = ref - new.
        x = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        per_token = per_token + kl_coef * (torch.exp(x) - x - 1.0)
    # where() rather than a product, so that a non-finite value on a masked token cannot leak in.
    loss = torch.where(mask, per_token * weights, torch.zeros_like(per_token)).sum()

    with torch.no_grad():
        m = mask.to(torch.float32)
        r = ratio.detach().float()
        adv = advantages.detach().float()
        # The clip is active (gradient zero) when the clipped term is the smaller one.
        clip_low = (r < 1.0 - eps_low) & (adv < 0)
        clip_high = (r > 1.0 + eps_high) & (adv > 0)
        lr = log_ratio.detach().float()
        metrics = {
            "tokens": m.sum(),
            "ratio_sum": (r * m).sum(),
            "ratio_max": torch.where(mask, r, torch.zeros_like(r)).max() if r.numel() else r.new_zeros(()),
            "clip_low_sum": (clip_low.float() * m).sum(),
            "clip_high_sum": (clip_high.float() * m).sum(),
            # k3 estimator of KL(behaviour || policy) on behaviour samples: (rho - 1) - log rho.
            "approx_kl_sum": (((r - 1.0) - lr) * m).sum(),
            "advantage_sum": (adv * m).sum(),
            "advantage_sq_sum": (adv * adv * m).sum(),
            "loss_unweighted_sum": (per_token.detach().float() * m).sum(),
        }
        if entropy is not None:
            metrics["entropy_sum"] = (entropy.detach().float() * m).sum()
    return loss, metrics


#: The metric sums :func:`decoupled_loss` adds to :func:`grpo_loss`'s.
DECOUPLED_METRICS = ("behaviour_weight_sum", "behaviour_capped_sum")


def decoupled_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    weight_cap: float = 0.0,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (see the module docstring): :func:`grpo_loss` against ``proximal_logp`` with
    each token's weight multiplied by ``proximal / behaviour`` (detached), tokens whose factor
    exceeds ``weight_cap`` (when > 0) left out. Metrics: :func:`grpo_loss`'s (``ratio_*`` and
    ``clip_*`` then against the proximal policy, counted over the tokens kept) plus
    ``behaviour_weight_sum`` (the factors of the tokens kept) and ``behaviour_capped_sum`` (tokens
    left out by the cap), both over the tokens of nonzero weight."""
    if proximal_logp.shape != logp.shape:
        raise ValueError(
            f"proximal_logp shape {tuple(proximal_logp.shape)} differs from logp {tuple(logp.shape)}"
        )
    if behaviour_logp.shape != logp.shape:
        raise ValueError(
            f"behaviour_logp shape {tuple(behaviour_logp.shape)} differs from logp {tuple(logp.shape)}"
        )
    with torch.no_grad():
        prox = proximal_logp.detach()
        factor = torch.exp((prox - behaviour_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        mask = weights != 0
        capped = mask & (factor > weight_cap) if weight_cap > 0 else torch.zeros_like(mask)
        kept = mask & ~capped
        # Exactly ``weights`` where the factor is 1 (proximal == behaviour): x * 1.0 == x.
        token_weights = torch.where(kept, weights * factor, torch.zeros_like(weights))
    loss, metrics = grpo_loss(
        logp, prox, advantages, token_weights, eps_low=eps_low, eps_high=eps_high, entropy=entropy
    )
    with torch.no_grad():
        metrics["behaviour_weight_sum"] = torch.where(kept, factor, torch.zeros_like(factor)).float().sum()
        metrics["behaviour_capped_sum"] = capped.float().sum()
    return loss, metrics


def reduce_loss_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine metric dicts of several microbatches: sums add, ``*_max`` take the max."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v.clone()
            elif k.endswith("_max"):
                out[k] = torch.maximum(out[k], v)
            else:
                out[k] = out[k] + v
    return out


def finalize_loss_metrics(summed: dict[str, torch.Tensor]) -> dict[str, float]:
    """Turn reduced sums into the logged means (per valid token)."""
    n = max(float(summed["tokens"]), 1.0)
    out = {"tokens": float(summed["tokens"])}
    for k, v in summed.items():
        if k.endswith("_sum") and k != "advantage_sq_sum":
            out[k[: -len("_sum")] + ("_frac" if k.startswith("clip_") else "_mean")] = float(v) / n
        elif k.endswith("_max"):
            out[k] = float(v)
    var = float(summed["advantage_sq_sum"]) / n - out["advantage_mean"] ** 2
    out["advantage_std"] = max(var, 0.0) ** 0.5
    return out
