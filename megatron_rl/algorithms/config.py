"""Configuration of the GRPO algorithm (advantages, filter, loss). Defaults are Magistral's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import ConfigFieldError, check_choice, check_range


@dataclass(kw_only=True)
class GRPOConfig:
    """GRPO as in Magistral: no KL, group-token normalisation, minibatch advantages, Clip-Higher."""

    group_norm: Literal["center", "center_std"] = "center"  # r - mean (paper) or (r - mean) / std
    minibatch_norm: bool = True  # standardise advantages over the minibatch (paper: on)
    adv_eps: float = 1e-6  # added to the std in advantage normalisation
    loss_norm: Literal["group", "token", "sequence"] = "group"  # per-token weight mode (paper: group)
    eps_low: float = 0.2  # lower clip: ratio >= 1 - eps_low
    eps_high: float = 0.28  # upper clip (Clip-Higher): ratio <= 1 + eps_high; paper 0.26-0.30
    filter_tolerance: float = 0.0  # drop a group when max(r) - min(r) <= this (0: exact equality)
    kl_coef: float = 0.0  # KL to a reference model; 0 = none and no reference model (paper)
    temperature: float = 1.0  # sampling temperature the behaviour log-probs were recorded at
    logprob_chunk_size: int = 0  # tokens per log-prob chunk; 0 = automatic (~64 MiB fp32 buffer)
    # MoE routing replay (R3): "rollout" -- the generators return each token's experts and the
    # trainer's routers take them in forward and backward, so the experts that produced a token
    # are the ones trained; "off" -- the trainer routes by its own router.
    routing_replay: Literal["off", "rollout"] = "off"
    # The policy objective. "magistral": the paper's, the ratio taken against the behaviour policy
    # (the generator's log-prob of each token). "decoupled": AReaL's decoupled PPO, the ratio
    # clipped against a proximal policy (the weights at the start of the step) and each token
    # weighted by proximal / behaviour (algorithms/loss.py decoupled_loss): a stale token moves the
    # policy no further than the trust region around the current weights allows.
    objective: Literal["magistral", "decoupled"] = "magistral"
    # decoupled only: tokens whose weight proximal / behaviour exceeds this are left out of the
    # loss (AReaL's behav_imp_weight_cap); 0 = keep every token.
    behaviour_weight_cap: float = 5.0

    def __post_init__(self) -> None:
        check_range("adv_eps", self.adv_eps, low=0.0, low_open=True)
        check_range("eps_low", self.eps_low, low=0.0, high=1.0, high_open=True)
        check_range("eps_high", self.eps_high, low=0.0)
        if self.eps_high < self.eps_low:
            raise ConfigFieldError(
                "eps_high", f"must be >= eps_low ({self.eps_low}) for Clip-Higher, got {self.eps_high}"
            )
        check_range("filter_tolerance", self.filter_tolerance, low=0.0)
        check_range("kl_coef", self.kl_coef, low=0.0)
        check_range("temperature", self.temperature, low=0.0, low_open=True)
        check_range("logprob_chunk_size", self.logprob_chunk_size, low=0)
        check_choice("objective", self.objective, ("magistral", "decoupled"))
        check_range("behaviour_weight_cap", self.behaviour_weight_cap, low=0.0)
        if self.behaviour_weight_cap and self.behaviour_weight_cap <= 1.0:
            raise ConfigFieldError(
                "behaviour_weight_cap",
                f"must be 0 (no cap) or above 1 (a cap of 1 or less drops on-policy tokens), "
                f"got {self.behaviour_weight_cap}",
            )
