"""Configuration of the policy trainer: optimizer, learning-rate schedule, precision, layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.training.parallel import ParallelConfig

__all__ = ["OptimConfig", "TrainerConfig"]


@dataclass(kw_only=True)
class OptimConfig:
    """Adam (decoupled weight decay) with linear warm-up and an optional decay, as in Megatron."""

    lr: float = 1e-6  # peak learning rate, reached at the end of the warm-up
    min_lr: float = 0.0  # learning rate at and after decay_steps (linear / cosine decay)
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay; RL fine-tuning usually uses 0
    adam_beta1: float = 0.9  # Adam first-moment decay, in [0, 1)
    adam_beta2: float = 0.95  # Adam second-moment decay, in [0, 1)
    adam_eps: float = 1e-8  # Adam denominator epsilon, > 0
    clip_grad: float = 1.0  # clip the global gradient norm to this (> 0; a huge value = no clip)
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr (0 = none)
    decay_steps: int = 0  # step at which min_lr is reached, warm-up included; 0 = no decay
    decay_style: Literal["constant", "linear", "cosine"] = "constant"  # shape after the warm-up

    def __post_init__(self):
        check_range("lr", self.lr, low=0.0, low_open=True)
        check_range("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_range("weight_decay", self.weight_decay, low=0.0)
        check_range("adam_beta1", self.adam_beta1, low=0.0, high=1.0, high_open=True)
        check_range("adam_beta2", self.adam_beta2, low=0.0, high=1.0, high_open=True)
        check_range("adam_eps", self.adam_eps, low=0.0, low_open=True)
        check_range("clip_grad", self.clip_grad, low=0.0, low_open=True)
        check_range("warmup_steps", self.warmup_steps, low=0)
        check_range("decay_steps", self.decay_steps, low=0)
        check_choice("decay_style", self.decay_style, ("constant", "linear", "cosine"))
        if self.decay_style != "constant" and self.decay_steps <= self.warmup_steps:
            raise ConfigFieldError(
                "decay_steps",
                f"decay_style {self.decay_style!r} needs "
                f"decay_steps > warmup_steps ({self.warmup_steps}), got "
                f"{self.decay_steps} (0 = no decay: use decay_style 'constant')",
            )


@dataclass(kw_only=True)
class TrainerConfig:
    """The policy trainer: model layout, optimizer, precision and memory options."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP x PP (x VPP); DP = rest
    optim: OptimConfig = field(default_factory=OptimConfig)  # Adam and the learning-rate schedule
    # Shard optimizer state over DP ranks. auto = on with CUDA, off on CPU: in megatron-core 0.16.1
    # a distributed-optimizer checkpoint does not resume on CPU (the plain optimizer resumes exactly).
    distributed_optimizer: Literal["auto", "on", "off"] = "auto"
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    seed: int = 1234  # weight init and dropout RNG, used when the trainer sets up parallel state
    recompute: bool = False  # full activation recomputation of every layer (memory for time)
    # torch intra-op threads of a CPU trainer (0: torch's default). On a small machine shared
    # with engine servers and verifiers, 1 avoids OpenMP threads spinning on busy cores.
    cpu_threads: int = 0
    # Optimizer steps in a row whose loss or gradient norm is NaN/inf that are skipped (weights,
    # optimizer state and LR schedule left as they were) before the trainer raises NonFiniteError.
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        check_choice("distributed_optimizer", self.distributed_optimizer, ("auto", "on", "off"))
        check_choice("precision", self.precision, ("auto", "bf16", "fp32"))
        check_range("seed", self.seed, low=0)
        check_range("cpu_threads", self.cpu_threads, low=0)
        check_range("max_nonfinite_steps", self.max_nonfinite_steps, low=1)

    def use_distributed_optimizer(self) -> bool:
        """``distributed_optimizer`` with ``auto`` resolved on this machine."""
        if self.distributed_optimizer == "auto":
            return torch.cuda.is_available()
        return self.distributed_optimizer == "on"

    def params_dtype(self) -> torch.dtype:
        """``precision`` with ``auto`` resolved on this machine (bf16 with CUDA, else fp32)."""
        if self.precision == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return torch.bfloat16 if self.precision == "bf16" else torch.float32
