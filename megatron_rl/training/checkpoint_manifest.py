"""Which checkpoint folders are complete and intact: names on disk, the manifest, ``latest`` and
the fallback to the newest intact checkpoint, and ``keep_last``'s pruning. Files only: nothing here
is collective (:mod:`megatron_rl.training.checkpoint` runs the save and load around it).

Layout on disk (``root`` is the folder given to
:func:`~megatron_rl.training.checkpoint.save_checkpoint`)::

    root/
      latest                     "step_00000012\\n", replaced atomically after each save
      step_00000012/             a complete checkpoint (the rename below is what makes it one)
        complete                 JSON marker: format, step, layout (TP/PP/DP/world/chunks), time,
                                 versions, what is inside (optimizer kind and format, scheduler, seed)
        manifest.json            size and sha256 of every other file, the marker included
        dist/                    model + optimizer, megatron.core.dist_checkpointing (torch_dist):
                                 every tensor under its global name and shape, any TP/PP reads it
        rng/rank_00000.pt        RNG states of each rank (:mod:`~megatron_rl.training.checkpoint_rng`)
        carried.safetensors      a vision-language model's vision tower and projector, as the HF
                                 files hold them (never trained; only when ``carried`` is given)
        scheduler.json           OptimizerParamScheduler.state_dict() (rank 0; same on every rank)
        extra.json               the caller's ``extra`` dict (rank 0's)
      step_00000012.tmp-3f9a1c/  a save in progress or a crashed one: never loaded, swept later

Sealing a save (:func:`publish`, rank 0, once every rank has written its files into the tmp
folder and digested its own with :func:`rank_digests`): write ``complete``, check that the
digests cover every file rank 0 sees with the size it sees, write ``manifest.json`` (atomically,
last), rename the folder to ``step_N`` (one atomic rename, so ``step_N`` never exists without its
marker and manifest), replace ``latest`` (tmp file + ``os.replace``), and only then delete
checkpoints beyond ``keep_last`` and leftovers of crashed saves.

Trust: the load checks every file against the manifest (present, size, sha256; the ranks share
the hashing, :func:`verify_share`) before reading any of it, and raises
:class:`CheckpointCorruptError` naming the file. Given a root, it tries the checkpoints of
:func:`candidates` in turn: the one ``latest`` names, then the complete ones below its step,
newest first, logging a warning for each one that fails; it raises only if none is intact.
:func:`latest_checkpoint` makes the same choice with a cheap check (every file present with its
size: no hashing) and never raises on a bad ``latest`` (not UTF-8, empty, garbage, naming a
missing folder: a warning, then a scan). ``keep_last`` counts only checkpoints that pass the cheap
check, and deletes only those older than the oldest one it keeps, so the newest intact checkpoint
is never deleted. The manifest protects against torn and partial writes, truncated copies and bit
rot, not against a deliberate edit (it is not signed). Hashing costs one read of the checkpoint
at save and one at load.

Checkpoints from before manifests (marker ``format`` 1) are accepted with a warning that their
files cannot be verified: refusing them would strand runs written by earlier versions, and they
are no less trustworthy than they were. A checkpoint of format 2 or later without a manifest
(deleted, or lost in a copy) is corrupt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.fileio import atomic_write_json, atomic_write_text, fsync_dir

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = [
    "DIST_DIR",
    "EXTRA_FILE",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "MARKER",
    "RNG_DIR",
    "SCHEDULER_FILE",
    "CheckpointCorruptError",
    "CheckpointError",
    "candidates",
    "checkpoint_dir_name",
    "latest_checkpoint",
    "list_checkpoints",
    "publish",
    "rank_digests",
    "read_latest",
    "verify_share",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: with manifest.json; 1: before manifests (loaded unverified: module docstring)
MARKER, LATEST, MANIFEST = "complete", "latest", "manifest.json"
DIST_DIR, RNG_DIR = "dist", "rng"
SCHEDULER_FILE, EXTRA_FILE = "scheduler.json", "extra.json"
_STEP_DIR = re.compile(r"step_(\d{8,})")
_LEFTOVER_DIR = re.compile(r"step_\d{8,}\.(tmp|trash)-[0-9a-f]+")
# Files named after the rank that wrote them: torch_dist's data files and the RNG states.
_RANK_FILE = {DIST_DIR: re.compile(r"__(\d+)_\d+\.distcp"), RNG_DIR: re.compile(r"rank_(\d+)\.pt")}
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or a rank failed while writing or reading one."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated, altered: names the
    file), or its marker or manifest is unreadable; under a root, no checkpoint was intact."""


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

    Not collective, and cheap: the first of :func:`candidates` whose files are all present with
    their manifest's sizes (no hashing; :func:`load_checkpoint` hashes). A bad ``latest`` or a
    checkpoint that fails the check is logged and passed over. Raises CheckpointCorruptError if
    there are complete checkpoints but none passes (resuming must not silently start over).
    """
    root = Path(root)
    if not list_checkpoints(root):
        return None
    problems: list[str] = []
    for ckpt in candidates(root):
        problem = _structure_problem(ckpt)
        if problem is None:
            if problems:
                log.warning("checkpoint: using %s instead", ckpt)
            return ckpt
        log.warning("checkpoint: %s is not intact, passed over: %s", ckpt, problem)
        problems.append(problem)
    raise CheckpointCorruptError(f"no intact checkpoint under {root}: {'; '.join(problems)}")


def candidates(path: Path) -> list[Path]:
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
    name = read_latest(path)
    steps = {p.name: s for s, p in found}
    if name in steps:
        return [path / name] + [p for s, p in reversed(found) if s < steps[name]]
    return [p for _, p in reversed(found)]


def read_latest(root: Path) -> str | None:
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


def verify_share(ckpt: Path, rank: int, world_size: int) -> str | None:
    """Why ``rank``'s share of ``ckpt``'s files fails the manifest (missing, resized or altered:
    hashed), or None; a checkpoint from before manifests passes, with a warning from rank 0.
    The shares of a ``world_size`` ranks: the largest files first, each to the rank with the
    fewest bytes so far (the same split on every rank). Raises OSError when a file cannot be
    read."""
    try:
        files = _read_manifest(ckpt)
        if files is None:
            if rank == 0:
                log.warning("checkpoint %s predates manifests (format 1): its files are not verified", ckpt)
            return None
        load, mine = [0] * world_size, []
        for rel in sorted(files, key=lambda r: (-files[r]["size"], r)):
            least = load.index(min(load))
            load[least] += files[rel]["size"]
            if least == rank:
                mine.append(rel)
        _check_files(ckpt, files, mine, digest=True)
    except CheckpointCorruptError as err:
        return str(err)
    return None


def rank_digests(folder: Path, rank: int, world_size: int) -> dict[str, dict[str, JsonValue]]:
    """The digests of the files under ``folder`` that ``rank`` wrote (see :func:`_owner`), by
    relative path: each rank digests its own, rank 0 gathers them for :func:`publish`."""
    return {rel: _digest(folder / rel) for rel in _files(folder) if _owner(rel, world_size) == rank}


# -- sealing a save -----------------------------------------------------------------------------


def publish(
    root: Path,
    tmp: Path,
    marker: dict[str, JsonValue],
    digests: dict[str, dict[str, JsonValue]],
    keep_last: int | None,
) -> Path:
    """Rank 0: seal the save in the folder ``tmp`` under ``root`` (module docstring): ``marker``,
    the manifest of ``digests`` (every rank's :func:`rank_digests`), the rename to ``step_N``,
    ``latest``, then pruning to ``keep_last`` (None: keep all). Returns the checkpoint's path.
    Raises CheckpointError if the digests and the files rank 0 sees differ."""
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
