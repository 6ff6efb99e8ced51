"""The whole recipe: every component's config composed into :class:`RunConfig`.

Recipes are small YAML files that set only what differs from the defaults (Magistral's values);
``key.sub=value`` overrides from the command line apply on top; every error names the file, the
line and the dotted field (:mod:`megatron_rl.config` does the reading)::

    cfg = load_config("examples/quickstart.yaml", ["algorithm.eps_high=0.3"])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.config import ConfigError, ConfigFieldError, config_from_dict, config_to_dict, load_dataclass
from megatron_rl.environments.config import EnvConfig
from megatron_rl.hf.hub import cached_snapshot, looks_like_hub_id
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

__all__ = [
    "PATH_FIELDS",
    "RunConfig",
    "check_before_run",
    "check_machine",
    "check_paths",
    "load_config",
    "validate_config",
]


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
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn environment (none: single-turn)

    def __post_init__(self) -> None:
        self.check_curriculum()
        if self.weight_sync.prefix_cache == "flush" and self.loop.mode == "async":
            raise ConfigFieldError(
                "weight_sync.prefix_cache",
                "flush needs loop.mode sync or colocated: SGLang flushes its prefix cache only "
                "when no request runs or waits, and the async loop keeps requests in flight across "
                "every update (keep counts the cached share as generator/prefix_cached_fraction)",
            )

        if self.env.enabled and self.algorithm.routing_replay == "rollout":
            raise ConfigFieldError(
                "env.custom", "routing replay (algorithm.routing_replay: rollout) is single-turn only"
            )
        cp = self.trainer.parallel.context_parallel
        if cp > 1 and self.batching.layout != "packed":
            raise ConfigFieldError(
                "batching.layout",
                f"trainer.parallel.context_parallel {cp} splits packed rows only; set batching.layout: "
                f"packed (got {self.batching.layout})",
            )

    def check_curriculum(self) -> None:
        """Check every stage as it will be applied, before anything starts: each stage's values
        over what the stages before it left (so a typo in stage 3 fails at load, not hours in),
        through the same component checks the stage will meet. Raises ConfigFieldError with the
        dotted field, e.g. ``curriculum.2.n_minibatch``."""
        loop, reward, algorithm = self.loop, self.reward, self.algorithm
        low, high = self.data.min_difficulty, self.data.max_difficulty
        previous_step: int | None = None
        for i, st in enumerate(self.curriculum):
            at = f"curriculum.{i}"
            name = st.name or f"stage{i + 1}"
            try:
                loop = replace(loop, **_set(st, "n_batch", "n_minibatch", "n_async"))
                reward = replace(reward, **_set(st, "l_max", "l_cache"))
                algorithm = replace(algorithm, **_set(st, "eps_high"))
            except ConfigFieldError as e:
                raise ConfigFieldError(
                    f"{at}.{e.field}", f"{e.message} (once stage {name!r} applies)"
                ) from None
            low = st.min_difficulty if st.min_difficulty is not None else low
            high = st.max_difficulty if st.max_difficulty is not None else high
            if low is not None and high is not None and low > high:
                raise ConfigFieldError(
                    f"{at}.min_difficulty",
                    f"{low} is above max_difficulty {high} once stage {name!r} applies: no problem is left",
                )
            if st.at_step is not None:
                if previous_step is not None and st.at_step < previous_step:
                    raise ConfigFieldError(
                        f"{at}.at_step",
                        f"stages apply in order; {st.at_step} is before the previous stage's {previous_step}",
                    )
                if self.loop.max_steps and st.at_step >= self.loop.max_steps:
                    raise ConfigFieldError(
                        f"{at}.at_step",
                        f"{st.at_step} is never reached (loop.max_steps is {self.loop.max_steps})",
                    )
                previous_step = st.at_step


def _set(stage: StageConfig, *names: str) -> dict[str, Any]:
    """The fields among ``names`` that ``stage`` sets (the others keep their values).

    ``Any``: each value is the stage's own typed field of that name (``StageConfig.n_batch:
    int | None``, not None here), the type of the component's field it overrides in
    ``replace``; a dict holds one value type for all its keys, and the component's
    ``__post_init__`` checks the values as ``replace`` builds it."""
    return {n: getattr(stage, n) for n in names if getattr(stage, n) is not None}


# Paths a recipe names, checked before a run starts anything.
PATH_FIELDS = ("model.hf", "model.tokenizer", "data.train", "data.eval")


def check_paths(cfg: RunConfig) -> None:
    """Raise ConfigFieldError naming the first path field that is set but does not exist
    (``hf:NAME`` data sets are resolved by their reader, not here), or ``run.dir`` when the run
    would write where it reads: the run directory is, or holds, one of those paths. A Hub id in
    ``model.hf`` / ``model.tokenizer`` that names no path here is replaced by its snapshot in the
    local Hugging Face cache (:mod:`megatron_rl.hf.hub`; never downloaded)."""
    run_dir = Path(cfg.run.dir).resolve()
    for dotted in PATH_FIELDS:
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value or str(value).startswith("hf:"):
            continue
        if not Path(value).exists() and section == "model" and looks_like_hub_id(str(value)):
            try:
                value = cached_snapshot(str(value), dotted)
            except ValueError as e:
                raise ConfigFieldError(dotted, str(e)) from None
            setattr(cfg.model, name, value)
        if not Path(value).exists():
            raise ConfigFieldError(dotted, f"no such file or folder: {value}")
        if Path(value).resolve().is_relative_to(run_dir):  # the run writes files and folders there
            raise ConfigFieldError(
                "run.dir", f"{cfg.run.dir} is or holds {dotted} ({value}): the run would write where it reads"
            )


def check_machine(cfg: RunConfig) -> None:
    """What this machine must hold for the run to start here: the built-in engine servers the run
    starts itself (``fleet.local_servers`` x ``fleet.threads`` torch threads, when no ``urls``)
    within a few per core. A recipe may be resolved elsewhere (``megatron-rl config``); ``train``
    checks it here, before it starts anything."""
    cores = os.cpu_count() or 1
    if not cfg.fleet.urls and cfg.fleet.local_servers * cfg.fleet.threads > 4 * cores:
        raise ConfigFieldError(
            "fleet.local_servers",
            f"{cfg.fleet.local_servers} servers x {cfg.fleet.threads} threads is more than 4 per core "
            f"on this machine ({cores} cores); start fewer, or give fleet.urls of servers elsewhere",
        )


def check_before_run(cfg: RunConfig) -> None:
    """Every check ``train`` makes before it starts anything: paths, then this machine."""
    check_paths(cfg)
    check_machine(cfg)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, paths: bool = False
) -> RunConfig:
    """Read a YAML recipe (or only defaults when ``path`` is None) and apply overrides; every
    curriculum stage is checked, and with ``paths`` every path the recipe names must exist and
    this machine must hold what the run starts (:func:`check_before_run`)."""
    return load_dataclass(RunConfig, path, overrides, check=check_before_run if paths else None)


def validate_config(cfg: RunConfig, *, paths: bool = True, source: str = "RunConfig") -> RunConfig:
    """Check a :class:`RunConfig` built or changed in Python exactly as :func:`load_config` checks
    a recipe, and return the checked copy. A dataclass checks its fields only when it is built, so
    ``cfg.loop.group_size = -3`` after that passes unseen; rebuilding the whole recipe from its
    values runs every field's type check and every ``__post_init__`` again (the loader's own
    code, :func:`config_from_dict`), then :func:`check_before_run`. Raises :class:`ConfigError` with
    the dotted field, as the command line reports it."""
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"{source}: expected a RunConfig, got {type(cfg).__name__}")
    checked = config_from_dict(RunConfig, config_to_dict(cfg), source=source)
    if paths:
        try:
            check_before_run(checked)
        except ConfigFieldError as e:
            raise ConfigError(f"{source}: {e.field}: {e.message}") from None
    return checked
