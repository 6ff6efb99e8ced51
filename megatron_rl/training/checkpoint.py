"""Training checkpoints that are written atomically and resume exactly, also at another TP/PP.

Usage (every rank of the default process group calls both; collective)::

    path = save_checkpoint(run_dir / "checkpoints", step, model_chunks, optimizer, scheduler,
                           extra={"sampler": cursor, "policy_version": v}, seed=cfg.seed)
    step, extra = load_checkpoint(run_dir / "checkpoints", model_chunks, optimizer, scheduler)

This module runs the save and the load over the ranks; the parts it is built from:

- :mod:`~megatron_rl.training.checkpoint_manifest`: the folders on disk, the manifest, ``latest``,
  which checkpoint a root resolves to (``latest_checkpoint``, ``list_checkpoints``), and pruning;
- :mod:`~megatron_rl.training.checkpoint_rng`: the RNG states, restored or reseeded;
- :mod:`~megatron_rl.training.checkpoint_collectives`: a failure on one rank raised on all;
- :mod:`~megatron_rl.training.checkpoint_io`: the tensors' writer, and a full disk named.

Write protocol: every rank writes into ``step_N.tmp-<random>/``; all ranks report success (a
barrier); each rank digests the files it wrote (``dist/__R_*.distcp``, ``rng/rank_R.pt``; rank 0
everything else), rank 0 gathers the digests and seals the save (marker, manifest, rename to
``step_N``, ``latest``, then pruning: ``checkpoint_manifest.publish``). All ranks must see the
same filesystem at ``root`` (a shared or parallel filesystem on a cluster): rank 0 renames what
the other ranks wrote, and a file only its writer can see fails the save. One job writes a given
root at a time. Weights that are NaN or inf are refused before anything is written
(:class:`NonFiniteError`).

Load: every file is checked against the manifest first, the ranks sharing the hashing; given a
root, a corrupt checkpoint is logged and passed over for the previous one
(``checkpoint_manifest``'s docstring says what the manifest protects against).

What resumes exactly:

- Model weights and optimizer state (Adam moments, step, fp32 main params of
  ``Float16OptimizerWithFloat16Params``, the grad scaler) of Megatron's plain optimizer, at any
  TP/PP/DP layout: they are stored by global tensor name, so a resumed run at another layout
  continues with bit-identical state; only the reduction order of its sums differs.
- The LR scheduler (its step count and settings) and the step; ``extra`` round-trips as JSON
  (tuples come back as lists, dict keys as strings).
- RNG states, at the same layout only (same world size, TP, PP, DP, chunks and device kind):
  every rank gets back its own states; at another layout every rank is reseeded
  deterministically from ``(seed, step)`` and its TP rank (``checkpoint_rng``).

What does not resume: Megatron's *distributed* optimizer on CPU (megatron-core 0.16.1; see
:data:`DISTRIBUTED_OPTIMIZER_ON_CPU`); its checkpoints are written (format ``dp_reshardable``
on CPU, ``fully_reshardable`` with CUDA) but loading one raises on CPU instead of guessing.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException

from megatron_rl.fileio import atomic_write_json, atomic_write_text
from megatron_rl.hf.files import CARRIED_FILE, write_carried
from megatron_rl.training.checkpoint_collectives import agree, all_or_none, gather_problems, on_rank0
from megatron_rl.training.checkpoint_io import DiskFullError, in_process_save_strategy, out_of_space
from megatron_rl.training.checkpoint_manifest import (
    DIST_DIR,
    EXTRA_FILE,
    FORMAT_VERSION,
    MARKER,
    RNG_DIR,
    SCHEDULER_FILE,
    CheckpointCorruptError,
    CheckpointError,
    candidates,
    checkpoint_dir_name,
    publish,
    rank_digests,
    read_latest,
    verify_share,
)
from megatron_rl.training.checkpoint_rng import (
    RankLayout,
    capture_rng,
    rank_layout,
    restore_or_reseed,
    rng_device,
    write_rng,
)
from megatron_rl.training.model import model_sharded_state_dict, unwrap_chunks
from megatron_rl.version import __version__

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_rl.fileio import JsonValue
    from megatron_rl.training.model import ModelChunks

__all__ = [
    "DISTRIBUTED_OPTIMIZER_ON_CPU",
    "CheckpointMismatchError",
    "NonFiniteError",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

DISTRIBUTED_OPTIMIZER_ON_CPU = (
    "Megatron's distributed optimizer does not resume on CPU with megatron-core 0.16.1: the format "
    "that reshards across TP/PP ('fully_reshardable') gathers its state with Tensor.cuda(), so "
    "only 'dp_reshardable' can be written without CUDA; that format cannot change TP/PP, and its "
    "loader (DistributedOptimizer.load_parameter_state_from_dp_reshardable) fails on fp32 "
    "parameters outside torch.no_grad and has not been verified to restore the state exactly. "
    "Use the plain optimizer (use_distributed_optimizer=False) on CPU; it resumes exactly."
)


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model/optimizer it is loaded into (names the tensor)."""


class NonFiniteError(RuntimeError):
    """NaN or inf where training cannot go on: the trainer's loss or gradient norm for
    ``TrainerConfig.max_nonfinite_steps`` steps in a row, or weights given to save_checkpoint.
    Defined here, beside the save that raises it, because the trainer imports this module."""


# -- what goes into dist_checkpointing ----------------------------------------------------------


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_kind(optimizer: MegatronOptimizer | None) -> str | None:
    """``None``, ``"plain"`` (Float16OptimizerWithFloat16Params / FP32Optimizer, possibly inside a
    ChainedOptimizer) or ``"distributed"`` (any DistributedOptimizer inside)."""
    if optimizer is None:
        return None
    from megatron.core.optimizer.distrib_optimizer import (
        DistributedOptimizer,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    inner = _inner_optimizers(optimizer)
    return "distributed" if any(isinstance(o, DistributedOptimizer) for o in inner) else "plain"


def _has_state(optimizer: MegatronOptimizer) -> bool:
    """Whether the optimizer has stepped: torch optimizers create their state on the first step."""
    return any(len(o.optimizer.state) for o in _inner_optimizers(optimizer))


def _reset_optimizer(optimizer: MegatronOptimizer) -> None:
    """Make ``optimizer`` what it was before its first step, around the freshly loaded weights.

    Clears the per-parameter state (Adam creates it again, step 0, on the next step) and copies
    the model's weights into the fp32 main params of a Float16 optimizer, which would otherwise
    overwrite the loaded weights with their old copies on the next step.
    """
    for inner in _inner_optimizers(optimizer):
        inner.optimizer.state.clear()
    optimizer.reload_model_params()


def _optimizer_metadata(kind: str | None, sharding: str | None) -> dict[str, bool | str | None]:
    # Without the prefix flag a ChainedOptimizer of several plain optimizers would key its state
    # by optimizer index, which depends on the layout.
    meta: dict[str, bool | str | None] = {"chained_optim_avoid_prefix": True}
    if kind == "distributed":
        meta["distrib_optim_sharding_type"] = sharding
    return meta


def _sharded_state_dict(
    chunks: list[GPTModel], optimizer: MegatronOptimizer | None, meta: dict[str, JsonValue], is_loading: bool
) -> ShardedStateDict:
    model = model_sharded_state_dict(chunks)
    state = {"model": model}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=meta)
    return state


def _versions() -> dict[str, str | None]:

    def version(dist_name: str) -> str | None:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "megatron_rl": __version__,
        "megatron_core": version("megatron-core"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


# -- save ---------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    model_chunks: ModelChunks,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    *,
    extra: dict[str, object] | None = None,
    keep_last: int | None = 3,
    seed: int | None = None,
    carried: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``root/step_<step>`` atomically; return its path (the same on every rank).

    Collective over the default process group (every rank calls it with the same ``root`` and
    ``step``; ``root`` on a filesystem all ranks share). ``model_chunks`` as the schedules take
    them (DDP/Float16Module wrappers are fine); ``optimizer`` a Megatron optimizer or None (model
    only); ``scheduler`` an ``OptimizerParamScheduler`` or None. ``extra`` must be JSON-
    serialisable; rank 0's is stored. ``seed`` (the run's) is recorded for reseeding at another
    layout. After the new checkpoint is complete and ``latest`` names it, complete checkpoints
    with lower steps beyond the newest ``keep_last`` intact ones (None: keep all) are deleted,
    along with leftovers of crashed saves (best effort: a failed deletion is logged; see
    :func:`~megatron_rl.training.checkpoint_manifest.publish`). Saving a step that already
    exists replaces it. ``carried`` (read on rank 0 only): HF-named tensors kept beside the
    model unchanged (a vision tower), so that the checkpoint exports whole (``megatron-rl
    convert mcore-to-hf``).

    Raises ValueError for bad arguments; NonFiniteError (naming a parameter) if any rank's
    weights hold NaN or inf, and TypeError if ``extra`` is not JSON-serialisable, both on every
    rank before anything is written; if a rank fails to write its part, its own error there and
    CheckpointError on the others, with nothing marked complete; CheckpointError if a file one
    rank wrote is not visible to rank 0 (``root`` not on a shared filesystem).
    """
    if step < 0 or int(step) != step:
        raise ValueError(f"step: must be an integer >= 0, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last: must be >= 1 or None (keep all), got {keep_last}")
    rng = capture_rng()  # first, so nothing below can advance a generator before it is saved
    root, rank = Path(root), dist.get_rank()
    chunks = unwrap_chunks(model_chunks)
    agree(_nonfinite_weights(chunks, root, step), NonFiniteError)
    layout = rank_layout(chunks)
    kind = _optimizer_kind(optimizer)
    # Before the first step there is no state to save; loading then resets the optimizer
    # (Megatron's loader would create moments without a step count, which Adam cannot use).
    opt_state = None if kind is None else ("saved" if _has_state(optimizer) else "empty")
    sharding = None
    if kind == "distributed":
        sharding = "fully_reshardable" if torch.cuda.is_available() else "dp_reshardable"
    meta = _optimizer_metadata(kind, sharding)
    state = _sharded_state_dict(chunks, optimizer, meta, is_loading=False)
    contents = {
        "optimizer": kind,
        "optimizer_state": opt_state,
        "optimizer_sharding": sharding,
        "optimizer_metadata": meta,
        "scheduler": scheduler is not None,
    }
    # This rank's share, about (the optimizer's state included): what a full disk would lack.
    # Counted before the save, which takes the state dict apart.
    needed = max(
        sum(t.data.numel() * t.data.element_size() for t in _sharded_tensors(state) if t.data is not None),
        _previous_share(root),  # the optimizer's state may be stored as objects, not tensors
    )
    started: list[Path] = []  # the tmp folder, once rank 0 made it
    try:
        return _write(
            root, step, state, started, extra, scheduler, carried, rng, layout, contents, seed, keep_last
        )
    except (Exception, DcpCheckpointException) as err:  # the latter is a BaseException
        problem = out_of_space(err, root, needed)
        if problem is None:
            raise
        if rank == 0:
            for tmp in started:  # nothing of it is kept: give the space back
                shutil.rmtree(tmp, ignore_errors=True)
        latest = read_latest(root)
        kept = f"{root / latest} is intact and stays the latest" if latest else "no earlier checkpoint"
        raise DiskFullError(f"{root}: no room for checkpoint step {step}: {problem}; {kept}") from err


def _previous_share(root: Path) -> int:
    """Bytes of the latest checkpoint's tensor files, per rank (0 if there is none)."""
    latest = read_latest(root)
    folder = root / latest / DIST_DIR if latest else None
    if folder is None or not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) // dist.get_world_size()


def _write(
    root: Path,
    step: int,
    state: ShardedStateDict,
    started: list[Path],
    extra: dict[str, object] | None,
    scheduler: OptimizerParamScheduler | None,
    carried: Iterable[tuple[str, torch.Tensor]] | None,
    rng: dict[str, object],
    layout: RankLayout,
    contents: dict[str, JsonValue],
    seed: int | None,
    keep_last: int | None,
) -> Path:
    """:func:`save_checkpoint`'s writing (collective): tmp folder, tensors, RNG, scheduler,
    carried tensors, digests, then :func:`publish`. ``started`` gets the tmp folder."""
    rank = dist.get_rank()
    tmp = Path(on_rank0(lambda: str(_start(root, step, extra))))
    started.append(tmp)
    from megatron.core import (
        dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    dist_checkpointing.save(
        state,
        str(tmp / DIST_DIR),
        sharded_strategy=in_process_save_strategy(),
        validate_access_integrity=True,
    )
    with all_or_none(f"writing {tmp}"):
        write_rng(tmp, rank, layout, rng)
        if rank == 0 and scheduler is not None:
            atomic_write_json(tmp / SCHEDULER_FILE, scheduler.state_dict())
        if rank == 0 and carried is not None:
            write_carried(tmp / CARRIED_FILE, carried)
    # Every rank has written all it writes (the agreement above is a barrier); each digests its own.
    world = dist.get_world_size()
    with all_or_none(f"digesting {tmp}"):
        mine = rank_digests(tmp, rank, world)
    gathered: list[dict[str, dict[str, JsonValue]]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    digests = {rel: d for part in gathered or [] for rel, d in part.items()}
    marker: dict[str, JsonValue] = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "layout": asdict(layout),
        "rng_device": rng_device(),
        "seed": seed,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unix_time": time.time(),
        "versions": _versions(),
        "contents": contents,
    }
    return Path(on_rank0(lambda: str(publish(root, tmp, marker, digests, keep_last))))


def _nonfinite_weights(chunks: list[GPTModel], root: Path, step: int) -> str | None:
    """What is wrong with this rank's weights if any is NaN or inf (a checkpoint of them could
    not be trained from), else None."""
    named = [
        (f"{i}." * (len(chunks) > 1) + n, p) for i, c in enumerate(chunks) for n, p in c.named_parameters()
    ]
    if not named:
        return None
    # One flag per tensor, one device-to-host copy for all of them.
    finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return (
        f"parameter {bad[0]!r} holds NaN or inf{more}; refusing to save step {step} "
        f"under {root} (nothing was written)"
    )


def _start(root: Path, step: int, extra: dict[str, object] | None) -> Path:
    """Rank 0: the tmp folder of a new save, with ``extra.json`` in it (checked first)."""
    text = json.dumps(extra or {}, indent=1, sort_keys=True) + "\n"  # TypeError before mkdir
    # secrets, not random: the python generator was just captured and must not advance.
    tmp = root / f"{checkpoint_dir_name(step)}.tmp-{secrets.token_hex(4)}"
    (tmp / DIST_DIR).mkdir(parents=True)
    (tmp / RNG_DIR).mkdir()
    atomic_write_text(tmp / EXTRA_FILE, text)
    return tmp


# -- load ---------------------------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike[str],
    model_chunks: ModelChunks,
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    *,
    strict: bool = True,
) -> tuple[int, dict[str, JsonValue]]:
    """Load a checkpoint into ``model_chunks``, ``optimizer``, ``scheduler``; ``(step, extra)``.

    Collective over the default process group. ``path`` is a checkpoint folder or a root (then
    the newest intact checkpoint of :func:`~megatron_rl.training.checkpoint_manifest.candidates`,
    as rank 0 sees it). Every file is checked against the manifest first (module docstring): a
    corrupt checkpoint under a root is logged and passed over for the previous one. Any TP/PP/DP
    layout loads a checkpoint written at any other, as long as the padded vocabulary and
    architecture agree. RNG states are restored exactly at the same layout and reseeded
    otherwise (:mod:`~megatron_rl.training.checkpoint_rng`). With
    ``strict=False`` model tensors missing from the checkpoint keep their current values; shape
    mismatches, and missing optimizer state when an optimizer is given, are errors either way.
    A checkpoint saved before the optimizer's first step resets the given optimizer to that
    state. With ``optimizer=None`` only the weights change: an optimizer built before the load
    must then be told (``optimizer.reload_model_params()``; a Float16 optimizer keeps fp32
    copies of the old weights otherwise), or be built after it.

    Raises FileNotFoundError (no complete checkpoint under a root), CheckpointCorruptError (the
    folder given is corrupt, naming the file, or no checkpoint under the root is intact),
    CheckpointError (incomplete checkpoint, unsupported optimizer format, scheduler/optimizer
    state absent), and
    CheckpointMismatchError naming the checkpoint and the tensor when shapes or names do not fit.
    All of them are raised on every rank before any collective that could hang.
    """
    ckpt = _choose(Path(path))
    with all_or_none(f"reading {ckpt / MARKER}"):
        marker = json.loads((ckpt / MARKER).read_text())
    chunks = unwrap_chunks(model_chunks)
    layout, saved = rank_layout(chunks), RankLayout(**marker["layout"])
    contents = marker["contents"]
    _check_optimizer_and_scheduler(ckpt, contents, optimizer, scheduler, saved, layout)
    load_optimizer = optimizer if contents["optimizer_state"] == "saved" else None
    state = _sharded_state_dict(chunks, load_optimizer, contents["optimizer_metadata"], is_loading=True)
    missing = _check_fits(ckpt, state, strict)
    if missing:
        log.warning(
            "checkpoint %s lacks %d model tensors (kept as they are): %s",
            ckpt,
            len(missing),
            ", ".join(sorted(missing)[:10]),
        )
        state["model"] = _without_keys(state["model"], missing)
    from megatron.core import (
        dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    loaded = dist_checkpointing.load(state, str(ckpt / DIST_DIR))
    with all_or_none(f"loading {ckpt}"):
        _load_states(ckpt, chunks, loaded, strict, optimizer, load_optimizer, scheduler)
        restore_or_reseed(ckpt, marker, saved, layout, chunks)
        extra = json.loads((ckpt / EXTRA_FILE).read_text())
    return int(marker["step"]), extra


def _verify(ckpt: Path) -> str | None:
    """Collective: why ``ckpt`` is not intact (a file missing, resized or altered), or None; the
    same answer on every rank. The ranks share the hashing (``verify_share``)."""
    try:
        problem = verify_share(ckpt, dist.get_rank(), dist.get_world_size())
    except Exception as err:  # noqa: BLE001 -- reported to every rank: none may skip the gather
        problem = f"{ckpt} cannot be read: {type(err).__name__}: {err}"
    problems = gather_problems(problem)
    return problems[0][1] if problems else None


def _choose(path: Path) -> Path:
    """Collective: the checkpoint :func:`load_checkpoint` reads for ``path``, verified (module
    docstring); a corrupt one under a root is logged and the next candidate tried."""
    options = [Path(p) for p in on_rank0(lambda: [str(c) for c in candidates(path)])]
    problems: list[str] = []
    for ckpt in options:
        problem = _verify(ckpt)
        if problem is None:
            if problems and dist.get_rank() == 0:
                log.warning("checkpoint: resuming from %s instead", ckpt)
            return ckpt
        if dist.get_rank() == 0:
            log.warning("checkpoint: %s is not intact, passed over: %s", ckpt, problem)
        problems.append(problem)
    if len(options) == 1 and options[0] == path:
        raise CheckpointCorruptError(problems[0])
    raise CheckpointCorruptError(f"no intact checkpoint under {path}: {'; '.join(problems)}")


def _load_states(
    ckpt: Path,
    chunks: list[GPTModel],
    loaded: ShardedStateDict,
    strict: bool,
    optimizer: MegatronOptimizer | None,
    load_optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
) -> None:
    """Copy what dist_checkpointing read into the modules, the optimizer and the scheduler."""
    # Loading copies into parameters (and the distributed optimizer's views of them); autograd
    # must not record that.
    with torch.no_grad():
        if len(chunks) == 1:
            chunks[0].load_state_dict(loaded["model"], strict=strict)
        else:
            for i, chunk in enumerate(chunks):
                chunk.load_state_dict(loaded["model"][f"model{i}"], strict=strict)
        if load_optimizer is not None:
            load_optimizer.load_state_dict(loaded["optimizer"])
        elif optimizer is not None:
            _reset_optimizer(optimizer)
    if scheduler is not None:
        # load_state_dict *adds* the saved step count to the current one; start from zero so a
        # scheduler that has already stepped ends up at the checkpoint's step, not past it.
        scheduler.num_steps = 0
        scheduler.load_state_dict(json.loads((ckpt / SCHEDULER_FILE).read_text()))


def _check_optimizer_and_scheduler(
    ckpt: Path,
    contents: dict[str, JsonValue],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    saved: RankLayout,
    layout: RankLayout,
) -> None:
    """Raise (the same on every rank: it reads only the marker) if the state cannot be loaded."""
    kind = _optimizer_kind(optimizer)
    if kind is not None and contents["optimizer"] is None:
        raise CheckpointError(f"{ckpt} holds no optimizer state; pass optimizer=None to load the model only")
    if kind is not None and kind != contents["optimizer"]:
        raise CheckpointError(
            f"{ckpt} holds {contents['optimizer']} optimizer state, the "
            f"optimizer given is {kind}; their formats differ"
        )
    if kind == "distributed":
        if not torch.cuda.is_available():
            raise CheckpointError(f"{ckpt}: {DISTRIBUTED_OPTIMIZER_ON_CPU}")
        moved = (saved.tensor_parallel, saved.pipeline_parallel, saved.model_chunks) != (
            layout.tensor_parallel,
            layout.pipeline_parallel,
            layout.model_chunks,
        )
        if contents["optimizer_sharding"] == "dp_reshardable" and moved:
            raise CheckpointError(
                f"{ckpt}: its distributed-optimizer state was written on CPU "
                "as 'dp_reshardable', which loads only at the TP/PP it was "
                f"written at ({saved.tensor_parallel}/"
                f"{saved.pipeline_parallel}), not at {layout.tensor_parallel}/"
                f"{layout.pipeline_parallel}"
            )
    if scheduler is not None and not contents["scheduler"]:
        raise CheckpointError(f"{ckpt} holds no LR scheduler state; pass scheduler=None")


def _sharded_tensors(state: ShardedStateDict) -> list[ShardedTensor]:
    """Every ShardedTensor in a sharded state dict, factories expanded (without changing it)."""
    from megatron.core.dist_checkpointing.dict_utils import (
        nested_values,  # lazy: megatron-core takes seconds to import; only this path needs it
    )
    from megatron.core.dist_checkpointing.mapping import (  # lazy: megatron-core takes seconds to import; only this path needs it
        ShardedTensor,
        ShardedTensorFactory,
    )

    out: list[ShardedTensor] = []
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory):
            out.extend(_sharded_tensors({"built": value.build()}))
        elif isinstance(value, ShardedTensor):
            out.append(value)
    return out


def _check_fits(ckpt: Path, state: ShardedStateDict, strict: bool) -> set[str]:
    """Compare every tensor this rank would load with the checkpoint's global names and shapes.

    Returns the model tensors (by global key) to skip when ``strict`` is False; raises
    CheckpointMismatchError on every rank if any rank found a shape mismatch or a missing
    tensor it may not skip. Collective (the verdict is agreed so that no rank goes on into
    dist_checkpointing's collectives while another has stopped).
    """
    from megatron.core import (
        dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    problem: str | None = None
    skip: set[str] = set()
    error_type: type[Exception] = CheckpointMismatchError
    try:
        stored = dist_checkpointing.load_tensors_metadata(str(ckpt / DIST_DIR))
        problems: list[str] = []
        for part in ("model", "optimizer"):
            for ten in _sharded_tensors({part: state.get(part, {})}):
                if ten.key not in stored:
                    if part == "model" and not strict:
                        skip.add(ten.key)
                    else:
                        problems.append(f"tensor {ten.key!r} is not in the checkpoint")
                elif tuple(stored[ten.key].global_shape) != tuple(ten.global_shape):
                    problems.append(
                        f"tensor {ten.key!r} has shape "
                        f"{tuple(stored[ten.key].global_shape)} in the checkpoint, "
                        f"the model expects {tuple(ten.global_shape)}"
                    )
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            problem = f"checkpoint {ckpt} does not fit: {problems[0]}{more}"
    except Exception as err:  # noqa: BLE001 -- unreadable metadata, reported to every rank
        problem = f"checkpoint {ckpt}: cannot read its tensor metadata: {err}"
        error_type = CheckpointError
    agree(problem, error_type)
    return skip


def _without_keys(state: object, keys: set[str]) -> object:
    """``state`` without the entries whose ShardedTensor/factory key is in ``keys``."""
    if isinstance(state, dict):
        return {k: _without_keys(v, keys) for k, v in state.items() if getattr(v, "key", None) not in keys}
    return state
