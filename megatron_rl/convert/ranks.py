"""Where a conversion's ranks come from: the caller's process group, or local CPU processes.

:func:`run_on_ranks` is the one place that decides, for the CLI and the Python API alike:

- one rank needed (TP x PP = 1): run here;
- inside a process group of several ranks (``torchrun``, or a caller's own group): run on those
  ranks, which must be a multiple of TP x PP (the rest are data-parallel copies that write
  nothing new);
- otherwise (a plain process, or one holding a one-rank group, as a notebook does after
  ``train``): start TP x PP local CPU processes in a fresh gloo group, run there, wait.

A user error raised on a local rank (a non-finite tensor, a bad file) comes back to the caller
as the same kind of error with the same one-line message; anything else comes back as a
RuntimeError carrying the rank's traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.distributed as dist

from megatron_rl.errors import InputError, OutputError, ResourceError, RunStopped, UsageError, UserError

__all__ = ["group_rank", "group_size", "quiet_megatron_warnings", "run_on_ranks"]

_KINDS: dict[int, type[UserError]] = {
    k.exit_code: k for k in (UsageError, InputError, OutputError, ResourceError, RunStopped)
}


@contextlib.contextmanager
def quiet_megatron_warnings() -> Iterator[None]:
    """Hide megatron-core's notices that concern training kernels or its own internals, not a
    conversion (no Apex / Transformer Engine on this machine, deprecated names it uses itself)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning
        )
        warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
        # megatron-core's own loader still calls torch's deprecated name; nothing for the user to do.
        warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated", category=FutureWarning)
        yield


def group_rank() -> int:
    """This process's rank in its process group, or torchrun's ``RANK`` (about to join), else 0."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def group_size() -> int:
    """Ranks this process already belongs to: its process group's, or torchrun's (about to be
    joined), else 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def run_on_ranks(
    world: int,
    fn: Callable[..., None],
    args: tuple,
    *,
    what: str = "--tp x --pp",
    announce: Callable[[str], None] | None = None,
) -> str:
    """Run ``fn(*args)`` on ``world`` model-parallel ranks (module docstring); returns where it
    ran: ``"here"``, ``"group"`` (the caller's ranks) or ``"local"`` (processes started here).
    Raises UsageError naming ``what`` when the caller's group cannot hold ``world`` ranks, before
    anything runs. ``announce`` is given one line saying which, before it starts."""
    have = group_size()
    if world == 1 and have == 1:
        fn(*args)
        return "here"
    if have > 1:
        if have % world:
            raise UsageError(
                f"{what} = {world} ranks does not divide the {have} ranks of this process group; "
                f"start a multiple of {world} ranks, or run without torchrun (the ranks are then "
                "started locally)"
            )
        if announce is not None and group_rank() == 0:
            announce(f"running on the {have} ranks of this process group")
        fn(*args)
        return "group"
    if announce is not None:
        announce(f"starting {world} local CPU ranks (gloo)")
    _spawn(world, fn, args)
    return "local"


def _rank_entry(rank: int, world: int, init_file: str, errors, fn, args) -> None:
    # Conversion is I/O and copies: CPU ranks over gloo, whatever accelerators the machine has.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        with quiet_megatron_warnings():
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
            try:
                fn(*args)
            finally:
                dist.destroy_process_group()
    except UserError as e:  # the user's mistake: its kind and line travel, not a stack
        errors.put((rank, e.exit_code, str(e)))
        raise SystemExit(1) from None
    except BaseException:  # noqa: BLE001 -- reported to the parent, which raises
        errors.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from None


def _spawn(world: int, fn, args: tuple) -> None:
    """Run ``fn(*args)`` on ``world`` local processes in one gloo group; raise if any fails
    (then the others are stopped: a rank waiting in a collective would wait forever)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="megatron-rl-convert-")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world, init_file, errors, fn, args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        pending = {p.sentinel: p for p in procs}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                p = pending.pop(cast(int, sentinel))  # wait() returns what it was given: int sentinels
                p.join()
                if p.exitcode != 0:
                    _raise_rank_failure(p.exitcode, errors)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init_file)


def _raise_rank_failure(exitcode: int | None, errors) -> None:
    """Raise what a failed rank reported: its user error as the same kind, else a RuntimeError."""
    report = None
    with contextlib.suppress(Exception):
        report = errors.get(timeout=5)
    if report is None:
        raise RuntimeError(f"a conversion rank exited with code {exitcode} and reported nothing")
    rank, code, text = report
    if code in _KINDS:
        raise _KINDS[code](text)
    raise RuntimeError(f"conversion rank {rank} exited with code {exitcode}\n{text}")
