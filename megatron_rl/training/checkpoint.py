"""Training checkpoints that are written atomically and resume exactly, also at another TP/PP.

Usage (every rank of the default process group calls both; collective)::

    path = save_checkpoint(run_dir / "checkpoints", step, model_chunks, optimizer, scheduler,
                           extra={"sampler": cursor, "policy_version": v}, seed=cfg.seed)
    step, extra = load_checkpoint(run_dir / "checkpoints", model_chunks, optimizer, scheduler)

Layout on disk (``root`` is the folder given to :func:`save_checkpoint`)::

    root/
      latest                     "step_00000012\\n", replaced atomically after each save
      step_00000012/             a complete checkpoint (the rename below is what makes it one)
        complete                 JSON marker: format, step, layout (TP/PP/DP/world/chunks), time,
                                 versions, what is inside (optimizer kind and format, scheduler, seed)
        manifest.json            size and sha256 of every other file, the marker included
        dist/                    model + optimizer, megatron.core.dist_checkpointing (torch_dist):
                                 every tensor under its global name and shape, any TP/PP reads it
        rng/rank_00000.pt        RNG states of each rank (python, numpy, torch CPU/CUDA, Megatron's
                                 tensor-parallel tracker), plain tensors and numbers
        carried.safetensors      a vision-language model's vision tower and projector, as the HF
                                 files hold them (never trained; only when ``carried`` is given)
        scheduler.json           OptimizerParamScheduler.state_dict() (rank 0; same on every rank)
        extra.json               the caller's ``extra`` dict (rank 0's)
      step_00000012.tmp-3f9a1c/  a save in progress or a crashed one: never loaded, swept later

Write protocol: every rank writes into ``step_N.tmp-<random>/``; all ranks report success (a
barrier); each rank digests the files it wrote (``dist/__R_*.distcp``, ``rng/rank_R.pt``; rank 0
everything else), rank 0 gathers the digests, writes ``complete``, checks that the digests cover
every file it sees with the size it sees, writes ``manifest.json`` (atomically, last), renames
the folder to ``step_N`` (one atomic rename, so ``step_N`` never exists without its marker and
manifest), replaces ``latest`` (tmp file + ``os.replace``), and only then deletes checkpoints
beyond ``keep_last`` and leftovers of crashed saves. All ranks must see the same filesystem at
``root`` (a shared or parallel filesystem on a cluster): rank 0 renames what the other ranks
wrote, and a file only its writer can see fails the save. One job writes a given root at a time.
Weights that are NaN or inf are refused before anything is written (:class:`NonFiniteError`).

Trust on load: :func:`load_checkpoint` checks every file against the manifest (present, size,
sha256; the ranks share the hashing) before reading any of it, and raises
:class:`CheckpointCorruptError` naming the file. Given a root, it tries the checkpoint ``latest``
names, then the complete ones below its step, newest first, logging a warning for each one that
fails; it raises only if none is intact. :func:`latest_checkpoint` makes the same choice with a
cheap check (every file present with its size: no hashing) and never raises on a bad ``latest``
(not UTF-8, empty, garbage, naming a missing folder: a warning, then a scan). ``keep_last``
counts only checkpoints that pass the cheap check, and deletes only those older than the oldest
one it keeps, so the newest intact checkpoint is never deleted. The manifest protects against
torn and partial writes, truncated copies and bit rot, not against a deliberate edit (it is not
signed). Hashing costs one read of the checkpoint at save and one at load.

Checkpoints from before manifests (marker ``format`` 1) are accepted with a warning that their
files cannot be verified: refusing them would strand runs written by earlier versions, and they
are no less trustworthy than they were. A checkpoint of format 2 or later without a manifest
(deleted, or lost in a copy) is corrupt.

What resumes exactly:

- Model weights and optimizer state (Adam moments, step, fp32 main params of
  ``Float16OptimizerWithFloat16Params``, the grad scaler) of Megatron's plain optimizer, at any
  TP/PP/DP layout: they are stored by global tensor name, so a resumed run at another layout
  continues with bit-identical state; only the reduction order of its sums differs.
- The LR scheduler (its step count and settings) and the step; ``extra`` round-trips as JSON
  (tuples come back as lists, dict keys as strings).
- RNG states, at the same layout only (same world size, TP, PP, DP, chunks and device kind):
  every rank gets back its own states. At another layout there is no one-to-one map from old
  ranks to new ones, so every rank is reseeded deterministically from ``(seed, step)`` and its
  TP rank, exactly as :func:`~megatron_rl.training.parallel.init_parallel` seeds a fresh run
  (one default-generator seed for all ranks, a tracker stream per TP rank) -- the rank enters
  through its TP coordinate only because ranks that hold replicated activations must draw the
  same dropout masks. ``seed`` is the one given to :func:`save_checkpoint`, or, if none was, a
  digest of rank 0's saved generator state. Training with dropout 0 (this project's default)
  does not consume these RNGs at all.

What does not resume: Megatron's *distributed* optimizer on CPU (megatron-core 0.16.1; see
:data:`DISTRIBUTED_OPTIMIZER_ON_CPU`); its checkpoints are written (format ``dp_reshardable``
on CPU, ``fully_reshardable`` with CUDA) but loading one raises on CPU instead of guessing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException

from megatron_rl import __version__
from megatron_rl.fileio import atomic_write_json, atomic_write_text, fsync_dir
from megatron_rl.hf.files import CARRIED_FILE, write_carried
from megatron_rl.training.checkpoint_io import DiskFullError, in_process_save_strategy, out_of_space
from megatron_rl.training.model import model_sharded_state_dict, unwrap_chunks

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
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "NonFiniteError",
    "checkpoint_dir_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT_VERSION = 2  # 2: with manifest.json; 1: before manifests (loaded unverified, see above)
MARKER, LATEST, MANIFEST = "complete", "latest", "manifest.json"
DIST_DIR, RNG_DIR = "dist", "rng"
SCHEDULER_FILE, EXTRA_FILE = "scheduler.json", "extra.json"
_STEP_DIR = re.compile(r"step_(\d{8,})")
_LEFTOVER_DIR = re.compile(r"step_\d{8,}\.(tmp|trash)-[0-9a-f]+")
# Files named after the rank that wrote them: torch_dist's data files and the RNG states.
_RANK_FILE = {DIST_DIR: re.compile(r"__(\d+)_\d+\.distcp"), RNG_DIR: re.compile(r"rank_(\d+)\.pt")}
_SHA256 = re.compile(r"[0-9a-f]{64}")

DISTRIBUTED_OPTIMIZER_ON_CPU = (
    "Megatron's distributed optimizer does not resume on CPU with megatron-core 0.16.1: the format "
    "that reshards across TP/PP ('fully_reshardable') gathers its state with Tensor.cuda(), so "
    "only 'dp_reshardable' can be written without CUDA; that format cannot change TP/PP, and its "
    "loader (DistributedOptimizer.load_parameter_state_from_dp_reshardable) fails on fp32 "
    "parameters outside torch.no_grad and has not been verified to restore the state exactly. "
    "Use the plain optimizer (use_distributed_optimizer=False) on CPU; it resumes exactly."
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or a rank failed while writing or reading one."""


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model/optimizer it is loaded into (names the tensor)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated, altered: names the
    file), or its marker or manifest is unreadable; under a root, no checkpoint was intact."""


class NonFiniteError(RuntimeError):
    """NaN or inf where training cannot go on: the trainer's loss or gradient norm for
    ``TrainerConfig.max_nonfinite_steps`` steps in a row, or weights given to save_checkpoint.
    Defined here, beside the save that raises it, because the trainer imports this module."""


# -- finding checkpoints ------------------------------------------------------------------------


def checkpoint_dir_name(step: int) -> str:
    """``step_00000012`` for step 12: zero-padded so names sort like steps."""
    return f"step_{step:08d}"


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, lowest step first.

    Only ``step_<digits>`` folders holding the ``complete`` marker count: a save in progress
    (``*.tmp-*``), a crashed one, or a folder someone renamed by hand without the marker does not.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and _is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from under ``root``, or None if there is no complete one.

    Not collective, and cheap: the first of :func:`_candidates` whose files are all present with
    their manifest's sizes (no hashing; :func:`load_checkpoint` hashes). A bad ``latest`` or a
    checkpoint that fails the check is logged and passed over. Raises CheckpointCorruptError if
    there are complete checkpoints but none passes (resuming must not silently start over).
    """
    root = Path(root)
    if not list_checkpoints(root):
        return None
    problems: list[str] = []
    for ckpt in _candidates(root):
        problem = _structure_problem(ckpt)
        if problem is None:
            if problems:
                log.warning("checkpoint: using %s instead", ckpt)
            return ckpt
        log.warning("checkpoint: %s is not intact, passed over: %s", ckpt, problem)
        problems.append(problem)
    raise CheckpointCorruptError(f"no intact checkpoint under {root}: {'; '.join(problems)}")


def _candidates(path: Path) -> list[Path]:
    """The checkpoints to try for ``path``, best first: ``[path]`` for a complete checkpoint;
    for a root, the one ``latest`` names, then the complete ones below its step, newest first
    (all complete ones, newest first, when ``latest`` is missing or unusable). Checkpoints above
    the step ``latest`` names belong to a run that was since resumed from earlier: never tried.

    Raises CheckpointError for an incomplete checkpoint folder, FileNotFoundError for a root
    without a complete checkpoint.
    """
    if _is_complete(path):
        return [path]
    if (path / DIST_DIR).exists() or _STEP_DIR.fullmatch(path.name) or _LEFTOVER_DIR.fullmatch(path.name):
        raise CheckpointError(
            f"{path} is an incomplete checkpoint (no '{MARKER}' marker: its "
            "save did not finish); load the root folder to get the latest "
            "complete one"
        )
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint under {path}")
    name = _read_latest(path)
    steps = {p.name: s for s, p in found}
    if name in steps:
        return [path / name] + [p for s, p in reversed(found) if s < steps[name]]
    return [p for _, p in reversed(found)]


def _read_latest(root: Path) -> str | None:
    """The checkpoint ``root/latest`` names, if it names a complete one; else None, with a
    warning saying why unless there is no ``latest`` at all. Never raises."""
    try:
        with (root / LATEST).open("rb") as f:
            raw = f.read(256)  # a checkpoint name is 14 bytes; anything longer is garbage anyway
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning(
            "checkpoint: cannot read %s/%s (%s); scanning for the newest checkpoint", root, LATEST, err
        )
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not _STEP_DIR.fullmatch(name):
        log.warning(
            "checkpoint: %s/%s holds %r, not a checkpoint name; scanning for the newest checkpoint",
            root,
            LATEST,
            raw[:40],
        )
        return None
    if not _is_complete(root / name):
        log.warning(
            "checkpoint: %s/%s names %s, which is missing or incomplete; scanning for the newest checkpoint",
            root,
            LATEST,
            name,
        )
        return None
    return name


# -- manifests ----------------------------------------------------------------------------------


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest, as sorted '/'-separated relative paths."""
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(folder).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _owner(rel: str, world_size: int) -> int:
    """The rank that digests file ``rel`` at save: the one whose number its name carries
    (``dist/__R_*.distcp``, ``rng/rank_R.pt``: the rank that wrote it, with its data still in
    that rank's page cache), else rank 0, which wrote the rest."""
    folder, _, name = rel.rpartition("/")
    pattern = _RANK_FILE.get(folder)
    match = pattern.fullmatch(name) if pattern else None
    rank = int(match.group(1)) if match else 0
    return rank if rank < world_size else 0


def _digest(path: Path) -> dict[str, JsonValue]:
    """``{"size": bytes, "sha256": hex}`` of a file, from one read of it."""
    with path.open("rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
        return {"size": f.tell(), "sha256": sha}


def _read_json(path: Path) -> dict[str, JsonValue]:
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing") from None
    except ValueError as err:  # not UTF-8, not JSON
        raise CheckpointCorruptError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{path} holds {type(value).__name__}, not a JSON object")
    return value


def _read_manifest(ckpt: Path) -> dict[str, dict[str, JsonValue]] | None:
    """The manifest's ``{file: {"size", "sha256"}}``, or None for a checkpoint from before
    manifests (format 1). Raises CheckpointCorruptError naming the file when the marker
    or the manifest is unreadable or malformed, or a format-2 checkpoint has no manifest."""
    marker = _read_json(ckpt / MARKER)
    if not (ckpt / MANIFEST).exists() and marker.get("format") == 1:
        return None
    files = _read_json(ckpt / MANIFEST).get("files")
    if not isinstance(files, dict) or MARKER not in files:
        raise CheckpointCorruptError(f"{ckpt / MANIFEST} does not list the checkpoint's files")
    for rel, entry in files.items():
        parts = Path(rel).parts
        well_formed = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
        )
        if not well_formed or not parts or Path(rel).is_absolute() or ".." in parts:
            raise CheckpointCorruptError(f"{ckpt / MANIFEST}: malformed entry {rel!r}: {entry!r}")
    return files


def _check_files(
    ckpt: Path, files: dict[str, dict[str, JsonValue]], names: list[str], *, digest: bool
) -> None:
    """Raise CheckpointCorruptError naming the first of ``names`` that is missing, has another
    size than the manifest's, or (``digest``) another sha256."""
    for rel in names:
        want, path = files[rel], ckpt / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path} is missing (listed in {MANIFEST})") from None
        if size != want["size"]:
            raise CheckpointCorruptError(
                f"{path} has {size} bytes, {MANIFEST} says {want['size']} (truncated or rewritten)"
            )
        if digest and (got := _digest(path)["sha256"]) != want["sha256"]:
            raise CheckpointCorruptError(
                f"{path} is corrupt: sha256 {got[:16]}..., {MANIFEST} says {want['sha256'][:16]}..."
            )


def _structure_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` is not intact by the cheap check (marker and manifest readable, every file
    present with its size), or None. Not collective; reads no file's contents."""
    try:
        files = _read_manifest(ckpt)
        if files is not None:
            _check_files(ckpt, files, sorted(files), digest=False)
    except CheckpointCorruptError as err:
        return str(err)
    except OSError as err:
        return f"{ckpt} cannot be read: {err}"
    return None


def _verify(ckpt: Path) -> str | None:
    """Collective: why ``ckpt`` is not intact (a file missing, resized or altered), or None; the
    same answer on every rank. The ranks share the hashing: the largest files first, each to
    the rank with the fewest bytes so far (the same split on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    try:
        files = _read_manifest(ckpt)
        if files is None and rank == 0:
            log.warning("checkpoint %s predates manifests (format 1): its files are not verified", ckpt)
        if files is not None:
            load, mine = [0] * world, []
            for rel in sorted(files, key=lambda r: (-files[r]["size"], r)):
                least = load.index(min(load))
                load[least] += files[rel]["size"]
                if least == rank:
                    mine.append(rel)
            _check_files(ckpt, files, mine, digest=True)
    except CheckpointCorruptError as err:
        problem = str(err)
    except Exception as err:  # noqa: BLE001 -- reported to every rank: none may skip the gather
        problem = f"{ckpt} cannot be read: {type(err).__name__}: {err}"
    problems = _problems(problem)
    return problems[0][1] if problems else None


def _choose(path: Path) -> Path:
    """Collective: the checkpoint :func:`load_checkpoint` reads for ``path``, verified (module
    docstring); a corrupt one under a root is logged and the next candidate tried."""
    candidates = [Path(p) for p in _on_rank0(lambda: [str(c) for c in _candidates(path)])]
    problems: list[str] = []
    for ckpt in candidates:
        problem = _verify(ckpt)
        if problem is None:
            if problems and dist.get_rank() == 0:
                log.warning("checkpoint: resuming from %s instead", ckpt)
            return ckpt
        if dist.get_rank() == 0:
            log.warning("checkpoint: %s is not intact, passed over: %s", ckpt, problem)
        problems.append(problem)
    if len(candidates) == 1 and candidates[0] == path:
        raise CheckpointCorruptError(problems[0])
    raise CheckpointCorruptError(f"no intact checkpoint under {path}: {'; '.join(problems)}")


# -- collectives that never leave a rank waiting ------------------------------------------------


def _on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only; every rank returns its result, or raises its exception.

    The other ranks raise a copy of rank 0's exception (same type and message; a
    CheckpointError quoting it if it cannot be pickled). Without this, a failure on rank 0 would
    leave the other ranks blocked in the next collective.
    """
    payload: list[Any] = [None]  # Any: ("ok", fn's result) or ("error", exception), pickled
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 -- forwarded to every rank below
            error = err
            try:
                pickle.dumps(err)
                payload[0] = ("error", err)
            except Exception:  # noqa: BLE001 -- an exception type that does not pickle
                payload[0] = ("error", CheckpointError(f"rank 0: {type(err).__name__}: {err}"))
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        if error is not None:
            raise error
        raise value
    return value


def _problems(problem: str | None) -> list[tuple[int, str]]:
    """Every rank's ``problem`` that is not None, as ``(rank, problem)``, on every rank."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return [(rank, p) for rank, p in enumerate(gathered) if p]


def _agree(
    problem: str | None, error_type: type[Exception] = CheckpointError, local: BaseException | None = None
) -> None:
    """Raise on every rank if any rank has a ``problem``: this rank's own exception ``local``
    where it has one, else ``error_type`` quoting the first rank's problem."""
    bad = _problems(problem)
    if not bad:
        return
    if local is not None:
        raise local
    rank, first = bad[0]
    more = f" (and problems on {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
    raise error_type(f"rank {rank}: {first}{more}")


@contextlib.contextmanager
def _all_or_none(what: str) -> Iterator[None]:
    """Run the block on every rank; if it raised on any rank, raise on all of them after it.

    For rank-local work (file reads and writes) followed by collectives: a rank that failed
    alone would otherwise leave the others blocked in the next collective until the timeout.
    """
    local = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 -- re-raised below, on every rank
        local = err
    _agree(None if local is None else f"{what}: {type(local).__name__}: {local}", local=local)


# -- layout and RNG -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Where each rank's shard and RNG streams came from; equal layouts map rank r to rank r."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    model_chunks: int  # > 1 with interleaved (virtual) pipeline stages


def _layout(chunks: list[GPTModel]) -> _Layout:
    """The layout these (unwrapped) chunks were built for, read from their process groups."""
    pgs = chunks[0].pg_collection
    world, tp, pp = dist.get_world_size(), pgs.tp.size(), pgs.pp.size()
    return _Layout(
        world_size=world,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=world // (tp * pp),
        model_chunks=len(chunks),
    )


def _rng_device() -> str:
    # CUDA generator states (and the tracker's, which are CUDA states on GPU) cannot be set on a
    # CPU-only machine, so a device change counts as a layout change for the RNG.
    return "cuda" if torch.cuda.is_available() else "cpu"


def _capture_rng() -> dict[str, object]:
    """This rank's RNG states as plain tensors, numbers and tuples (``weights_only``-loadable)."""
    from megatron.core.tensor_parallel import (
        get_cuda_rng_tracker,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    legacy = np.random.get_state()
    if isinstance(legacy, dict):  # only if someone replaced the global generator's MT19937
        raise CheckpointError("numpy's global generator is not MT19937; its state cannot be saved")
    kind, keys, pos, has_gauss, gauss = legacy
    state: dict[str, object] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch_cpu": torch.get_rng_state(),
        "tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:  # Any: the tuples and tensors _capture_rng stored
    """Inverse of :func:`_capture_rng`."""
    from megatron.core.tensor_parallel import (
        get_cuda_rng_tracker,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state:
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    tracker = get_cuda_rng_tracker()
    if state["tracker"]:
        tracker.set_states(dict(state["tracker"]))


def _reseed_rng(base_seed: int, step: int, tp_rank: int) -> None:
    """Seed every generator from ``(base_seed, step)`` the way ``init_parallel`` seeds a new run.

    The 32-bit seed (numpy's limit) comes from a hash, so nearby steps get unrelated streams.
    """
    from megatron.core import (
        tensor_parallel,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    digest = hashlib.sha256(f"megatron-rl-reseed:{base_seed}:{step}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank)


def _rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank_{rank:05d}.pt"


def _state_seed(ckpt: Path) -> int:
    """A seed that is a deterministic function of the checkpoint: rank 0's torch generator."""
    state = torch.load(_rng_file(ckpt, 0), weights_only=True)
    return int.from_bytes(hashlib.sha256(state["torch_cpu"].numpy().tobytes()).digest()[:8], "little")


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
    :func:`_prune`). Saving a step that already exists replaces it. ``carried`` (read on rank 0
    only): HF-named tensors kept beside the model unchanged (a vision tower), so that the
    checkpoint exports whole (``megatron-rl convert mcore-to-hf``).

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
    rng = _capture_rng()  # first, so nothing below can advance a generator before it is saved
    root, rank = Path(root), dist.get_rank()
    chunks = unwrap_chunks(model_chunks)
    _agree(_nonfinite_weights(chunks, root, step), NonFiniteError)
    layout = _layout(chunks)
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
        latest = _read_latest(root)
        kept = f"{root / latest} is intact and stays the latest" if latest else "no earlier checkpoint"
        raise DiskFullError(f"{root}: no room for checkpoint step {step}: {problem}; {kept}") from err


def _previous_share(root: Path) -> int:
    """Bytes of the latest checkpoint's tensor files, per rank (0 if there is none)."""
    latest = _read_latest(root)
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
    layout: _Layout,
    contents: dict[str, JsonValue],
    seed: int | None,
    keep_last: int | None,
) -> Path:
    """:func:`save_checkpoint`'s writing (collective): tmp folder, tensors, RNG, scheduler,
    carried tensors, digests, then :func:`_finalize`. ``started`` gets the tmp folder."""
    rank = dist.get_rank()
    tmp = Path(_on_rank0(lambda: str(_start(root, step, extra))))
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
    with _all_or_none(f"writing {tmp}"):
        torch.save({"layout": asdict(layout), "rank": rank, **rng}, _rng_file(tmp, rank))
        if rank == 0 and scheduler is not None:
            atomic_write_json(tmp / SCHEDULER_FILE, scheduler.state_dict())
        if rank == 0 and carried is not None:
            write_carried(tmp / CARRIED_FILE, carried)
    # Every rank has written all it writes (the agreement above is a barrier); each digests its own.
    world = dist.get_world_size()
    with _all_or_none(f"digesting {tmp}"):
        mine = {rel: _digest(tmp / rel) for rel in _files(tmp) if _owner(rel, world) == rank}
    gathered: list[dict[str, dict[str, JsonValue]]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    digests = {rel: d for part in gathered or [] for rel, d in part.items()}
    marker: dict[str, JsonValue] = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "layout": asdict(layout),
        "rng_device": _rng_device(),
        "seed": seed,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unix_time": time.time(),
        "versions": _versions(),
        "contents": contents,
    }
    return Path(_on_rank0(lambda: str(_finalize(root, tmp, marker, digests, keep_last))))


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


def _finalize(
    root: Path,
    tmp: Path,
    marker: dict[str, JsonValue],
    digests: dict[str, dict[str, JsonValue]],
    keep_last: int | None,
) -> Path:
    """Rank 0: marker, manifest, rename into place, ``latest``, then pruning (in that order)."""
    atomic_write_json(tmp / MARKER, marker)
    files = {**digests, MARKER: _digest(tmp / MARKER)}
    seen = set(_files(tmp))
    problems = [f"{rel}: digested by its rank but not visible on rank 0" for rel in sorted(set(files) - seen)]
    problems += [f"{rel}: digested by no rank" for rel in sorted(seen - set(files))]
    problems += [
        f"{rel}: changed after it was digested"
        for rel in sorted(seen & set(files))
        if (tmp / rel).stat().st_size != files[rel]["size"]
    ]
    if problems:
        raise CheckpointError(
            f"saving {tmp}: {problems[0]} (+{len(problems) - 1} more); all ranks must see the "
            "same filesystem at the checkpoint root, and nothing else may write there"
        )
    # "format" here is the manifest's own layout, apart from the marker's checkpoint format.
    manifest = {"format": 1, "algorithm": "sha256", "step": marker["step"], "files": files}
    atomic_write_json(tmp / MANIFEST, manifest)  # last: a folder with a manifest is whole
    final = root / checkpoint_dir_name(marker["step"])
    old = None
    if final.exists():  # re-saving a step: move the old one aside, delete it once replaced
        old = _trash_name(final)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, final.name + "\n")
    try:
        if old is not None:
            shutil.rmtree(old)
        _prune(root, final, marker["step"], keep_last)
    except OSError as err:  # the new checkpoint is complete; a failed cleanup must not fail it
        log.warning("checkpoint: cleaning up %s after saving %s failed: %s", root, final, err)
    return final


def _trash_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.trash-{secrets.token_hex(4)}")


def _prune(root: Path, new: Path, step: int, keep_last: int | None) -> None:
    """Delete older complete checkpoints beyond ``keep_last`` and leftovers of crashed saves.

    Only intact checkpoints (:func:`_structure_problem`, the cheap check) count: the new one
    (just digested and checked: the newest intact one) and the ``keep_last - 1`` newest intact
    ones below it are kept, and so is everything between them; only checkpoints older than the
    oldest kept one are deleted. So a broken checkpoint never pushes an intact one out, and one
    that merely looks broken (a flaky read) is not deleted for it. A checkpoint is first renamed
    to ``*.trash-*`` (one atomic step that also takes its marker away), then deleted: an
    interrupted deletion leaves a leftover, never a broken "complete" one. Checkpoints with a
    higher step than the new one (a run resumed from an earlier step) are kept.
    """
    if keep_last is not None:
        older = [(s, path) for s, path in list_checkpoints(root) if s < step and path != new]
        intact = [s for s, path in older if _structure_problem(path) is None]
        cutoff = -1  # keep_last > 1 and no intact older checkpoint yet: keep them all for now
        if keep_last == 1:
            cutoff = step
        elif intact:
            cutoff = intact[max(0, len(intact) - (keep_last - 1))]
        for s, path in older:
            if s < cutoff:
                trash = _trash_name(path)
                path.rename(trash)
                shutil.rmtree(trash)
    for entry in root.iterdir():
        if _LEFTOVER_DIR.fullmatch(entry.name) and entry.is_dir():
            shutil.rmtree(entry)


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
    the newest intact checkpoint of :func:`_candidates`, as rank 0 sees it). Every file is
    checked against the manifest first (module docstring): a corrupt checkpoint under a root is
    logged and passed over for the previous one. Any TP/PP/DP layout loads a checkpoint
    written at any other, as long as the padded vocabulary and architecture agree. RNG states are
    restored exactly at the same layout and reseeded otherwise (module docstring). With
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
    with _all_or_none(f"reading {ckpt / MARKER}"):
        marker = json.loads((ckpt / MARKER).read_text())
    chunks = unwrap_chunks(model_chunks)
    layout, saved = _layout(chunks), _Layout(**marker["layout"])
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
    with _all_or_none(f"loading {ckpt}"):
        _load_states(ckpt, chunks, loaded, strict, optimizer, load_optimizer, scheduler)
        _restore_or_reseed(ckpt, marker, saved, layout, chunks)
        extra = json.loads((ckpt / EXTRA_FILE).read_text())
    return int(marker["step"]), extra


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
    saved: _Layout,
    layout: _Layout,
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
    _agree(problem, error_type)
    return skip


def _without_keys(state: object, keys: set[str]) -> object:
    """``state`` without the entries whose ShardedTensor/factory key is in ``keys``."""
    if isinstance(state, dict):
        return {k: _without_keys(v, keys) for k, v in state.items() if getattr(v, "key", None) not in keys}
    return state


def _restore_or_reseed(
    ckpt: Path, marker: dict[str, JsonValue], saved: _Layout, layout: _Layout, chunks: list[GPTModel]
) -> None:
    """Exact RNG states at the same layout and device kind; a deterministic reseed otherwise."""
    rank = dist.get_rank()
    if saved == layout and marker["rng_device"] == _rng_device():
        state = torch.load(_rng_file(ckpt, rank), weights_only=True)
        if _Layout(**state["layout"]) != layout or state["rank"] != rank:
            raise CheckpointError(
                f"{_rng_file(ckpt, rank)} was written by rank {state['rank']} "
                f"of layout {state['layout']}, not rank {rank} of {layout}"
            )
        _restore_rng(state)
        return
    seed = marker["seed"] if marker["seed"] is not None else _state_seed(ckpt)
    log.info(
        "checkpoint %s: written at %s on %s, loaded at %s on %s; RNGs reseeded from (seed, step=%d)",
        ckpt,
        saved,
        marker["rng_device"],
        layout,
        _rng_device(),
        marker["step"],
    )
    _reseed_rng(seed, int(marker["step"]), tp_rank=chunks[0].pg_collection.tp.rank())
