"""The Python API: the recipe object and the verbs, for notebooks and other programs.

    from megatron_rl import RunConfig, load_config, train, score, convert_checkpoint

    cfg = load_config("examples/quickstart.yaml", ["loop.max_steps=2"])   # or RunConfig(...)
    summary = train(cfg)                                  # what `megatron-rl train` prints
    results = score([{"problem": "What is 2+2?", "answer": "4", "completion": "..."}], cfg.reward)
    convert_checkpoint("hf_folder", "mcore_folder", to="mcore", tensor_parallel=2)

Each verb is the command-line verb's own code (``orchestration.run.run_training``, the reward
CLI's line parser and ``rewards.compose.score_many``, ``convert.run.convert``), so a recipe, a
record or a checkpoint behaves the same from Python as from the shell. Errors are exceptions
rather than exit codes: ``ConfigError`` (a recipe field, with file:line), ``DataError`` (a record,
with its index and field), ``NoProgressError`` / ``NonFiniteError`` / ``CheckpointCorruptError``
(a run that cannot go on). ``import megatron_rl`` stays cheap: the package root imports this
module on first use of one of these names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from megatron_rl.cli.reward import parse_line
from megatron_rl.config import ConfigError
from megatron_rl.data.problems import DataError
from megatron_rl.errors import UsageError
from megatron_rl.fileio import JsonValue
from megatron_rl.orchestration.recipe import RunConfig, load_config, validate_config
from megatron_rl.rewards.compose import RewardConfig, score_many
from megatron_rl.rewards.result import RewardResult

__all__ = [
    "ConfigError",
    "DataError",
    "RewardConfig",
    "RunConfig",
    "convert_checkpoint",
    "load_config",
    "score",
    "train",
]


def train(
    config: RunConfig | str | os.PathLike[str],
    overrides: Iterable[str] = (),
    *,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, object]:
    """Run (or resume) a recipe, as ``megatron-rl train``: ``config`` is a :class:`RunConfig` or
    the path of a YAML recipe (``overrides``: ``section.key=value`` strings, as on the command
    line; for a :class:`RunConfig` set its fields instead). Returns the run's summary (steps,
    pass@1 before and after, the run directory, ...) on rank 0, ``{}`` on the other ranks."""
    from megatron_rl.orchestration.run import run_training  # lazy: torch, megatron-core

    if isinstance(config, RunConfig):
        if list(overrides):
            raise ValueError(
                "overrides: set the RunConfig's fields instead (overrides go with a recipe path)"
            )
        # Checked again here, as the loader checks a recipe: the caller may have changed fields
        # after the dataclass was built, and a dataclass checks them only at construction.
        cfg = validate_config(config, source="train(config)")
    else:
        cfg = load_config(Path(config), list(overrides), paths=True)
    return run_training(cfg, progress=progress, stop_after=stop_after)


def score(
    records: Iterable[Mapping[str, JsonValue]],
    reward: RewardConfig | None = None,
    *,
    workers: int | None = None,
) -> list[RewardResult]:
    """Score completions with the real reward, as ``megatron-rl reward``: each record is a
    problem (``problem``, ``answer`` or ``tests``, any extra field) with its ``completion`` (and
    optionally ``num_tokens`` for the length penalty, ``group_id``). Results in input order, each
    with ``reward``, ``parts``, ``reason``, ``detail``, ``correct``. A malformed record raises
    :class:`DataError` naming ``records[i]`` and the field, before anything is scored."""
    cfg = reward or RewardConfig()
    if workers is not None:
        cfg = dataclasses.replace(cfg, workers=workers)
    inputs = []
    for i, obj in enumerate(records):
        if not isinstance(obj, Mapping):
            raise DataError(f"records[{i}]: expected an object, got {type(obj).__name__}")
        inputs.append(parse_line(dict(obj), f"records[{i}]", needs_reference=not cfg.replaces_correctness))
    return score_many(inputs, cfg) if inputs else []


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Literal["mcore", "hf"],
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    hf_config: str | os.PathLike[str] | None = None,
    dtype: str = "keep",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a checkpoint, as ``megatron-rl convert`` (the same function,
    :func:`megatron_rl.convert.run.convert`): ``to="mcore"`` reads the HF folder ``src`` and
    writes the Megatron checkpoint ``dst`` at ``tensor_parallel x pipeline_parallel`` (it loads
    at any layout), starting that many local CPU ranks itself unless this process is one rank
    of a ``torchrun`` group that can hold them; ``to="hf"`` exports the Megatron checkpoint
    ``src`` as an HF folder (``hf_config``: a folder with config.json, for a checkpoint written
    by Megatron itself). ``progress``: one line per stage on stderr, a bar on a terminal, and
    the closing ``wrote ...`` line. Refusals raise :mod:`megatron_rl.errors` exceptions
    (``UsageError``, ``InputError`` -- also for a tensor holding NaN/Inf unless
    ``allow_nonfinite`` -- ``OutputError``) before anything is written. Returns ``dst``."""
    from megatron_rl.convert.run import convert  # lazy: torch, megatron-core

    if to not in ("mcore", "hf"):
        raise UsageError(f"to: must be 'mcore' or 'hf', got {to!r}")
    return convert(
        "hf-to-mcore" if to == "mcore" else "mcore-to-hf",
        src,
        dst,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        hf_config=hf_config,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        allow_nonfinite=allow_nonfinite,
        progress=progress,
    )
