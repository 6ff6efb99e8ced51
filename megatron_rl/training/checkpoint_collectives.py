"""Collectives that never leave a rank waiting: a failure on one rank is raised on every rank.

The checkpoint's save and load mix rank-local work (file reads and writes, hashing) with
collectives (``dist_checkpointing``, gathers). A rank that failed alone and raised would leave the
others blocked in the next collective until the process group's timeout; these helpers turn a
local failure into an agreed one first. Every rank of the default process group must call them,
in the same order.

- :func:`on_rank0`: run a function on rank 0 only; every rank returns its result or raises its
  exception.
- :func:`gather_problems` / :func:`agree`: every rank's problem (a string or None), and raising on
  every rank if any has one.
- :func:`all_or_none`: a block run on every rank, raised on all of them if it raised on any.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from megatron_rl.training.checkpoint_manifest import CheckpointError

__all__ = ["agree", "all_or_none", "gather_problems", "on_rank0"]

T = TypeVar("T")


def on_rank0(fn: Callable[[], T]) -> T:
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


def gather_problems(problem: str | None) -> list[tuple[int, str]]:
    """Every rank's ``problem`` that is not None, as ``(rank, problem)``, on every rank."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return [(rank, p) for rank, p in enumerate(gathered) if p]


def agree(
    problem: str | None, error_type: type[Exception] = CheckpointError, local: BaseException | None = None
) -> None:
    """Raise on every rank if any rank has a ``problem``: this rank's own exception ``local``
    where it has one, else ``error_type`` quoting the first rank's problem."""
    bad = gather_problems(problem)
    if not bad:
        return
    if local is not None:
        raise local
    rank, first = bad[0]
    more = f" (and problems on {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
    raise error_type(f"rank {rank}: {first}{more}")


@contextlib.contextmanager
def all_or_none(what: str) -> Iterator[None]:
    """Run the block on every rank; if it raised on any rank, raise on all of them after it.

    For rank-local work (file reads and writes) followed by collectives: a rank that failed
    alone would otherwise leave the others blocked in the next collective until the timeout.
    """
    local = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 -- re-raised below, on every rank
        local = err
    agree(None if local is None else f"{what}: {type(local).__name__}: {local}", local=local)
