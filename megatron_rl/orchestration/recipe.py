"""The whole recipe: every component's config composed into :class:`RunConfig`.

Recipes are small YAML files that set only what differs from the defaults (Magistral's values);
``key.sub=value`` overrides from the command line apply on top; every error names the file, the
line and the dotted field (:mod:`megatron_rl.config` does the reading)::

    cfg = load_config("examples/quickstart.yaml", ["algorithm.eps_high=0.3"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.config import load_dataclass
from megatron_rl.orchestration.config import (
    DataConfig,
    FleetConfig,
    LoopConfig,
    ModelConfig,
    RunDirConfig,
    StageConfig,
)
from megatron_rl.rewards.compose import RewardConfig
from megatron_rl.training.config import TrainerConfig
from megatron_rl.weight_sync.broadcast import WeightSyncConfig

__all__ = ["RunConfig", "load_config"]


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs; each section is its component's own config."""

    algorithm: GRPOConfig = field(default_factory=GRPOConfig)  # GRPO loss and advantages
    batching: BatchingConfig = field(default_factory=BatchingConfig)  # microbatches, DP assignment
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward weights, verifier limits
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # parallelism, optimizer, precision
    model: ModelConfig = field(default_factory=ModelConfig)  # the initial policy (HF folder)
    data: DataConfig = field(default_factory=DataConfig)  # problems, system prompt, difficulty
    loop: LoopConfig = field(default_factory=LoopConfig)  # group size, n_batch, n_async, steps
    fleet: FleetConfig = field(default_factory=FleetConfig)  # generation servers
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # trainer -> fleet
    run: RunDirConfig = field(default_factory=RunDirConfig)  # run directory, checkpoints
    curriculum: list[StageConfig] = field(default_factory=list)  # stages, in order


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML recipe (or only defaults when ``path`` is None) and apply overrides."""
    return load_dataclass(RunConfig, path, overrides)
