"""How a checkpoint's tensors reach the disk: written by this process, and a full disk named.

**In this process.** Megatron-Core's ``torch_dist`` writer (``FileSystemWriterAsync``) forks a
writer process per file for every save and returns their results through a queue served by a
``multiprocessing.Manager``: a *spawned* server process that lives as long as the trainer. A
trainer killed with ``kill -9`` (or during a save) leaves both behind with parent 1, and a
Manager that dies mid-run fails the next save with ``BrokenPipeError``. Our saves are
synchronous (the step waits for them either way), so :class:`InProcessTorchDistSave` keeps the
same format, files and planning and only runs the write here: no helper process to outlive the
run or to lose. Megatron's writer is kept as it is (``_write_bucket`` calls its per-file
function), so a checkpoint is byte-for-byte what Megatron's own save writes.

**A full disk** comes back from Megatron's writer as ``RuntimeError: Worker failure: [enforce
fail at inline_container.cc:672] unexpected pos ...`` (PyTorch's zip writer loses the errno).
:func:`space_problem` says what is short (bytes needed, bytes free on the filesystem, or the
file-size limit ``ulimit -f``) so the caller can raise :class:`DiskFullError` naming the path.
"""

from __future__ import annotations

import errno
import queue
import resource
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.errors import ResourceError

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

__all__ = ["DiskFullError", "in_process_save_strategy", "out_of_space", "space_problem"]

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFullError(ResourceError):
    """A checkpoint could not be written for want of space (exit 5): names the path, the bytes
    needed and free. Nothing of it was kept; the previous checkpoint is untouched."""


def _write_buckets(
    transform_list: list[object],
    use_msc: bool,
    rank: int,
    write_buckets: list[object],
    results: queue.Queue[object],
) -> None:
    """Megatron's ``write_preloaded_data_multiproc`` without the processes: each file written in
    turn by its per-file function, results (or the first error) put where the finalisation
    reads them."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,  # lazy: megatron-core takes seconds to import; only a save needs it
    )

    written: dict[int, object] = {}
    for i, bucket in enumerate(write_buckets):
        done: queue.SimpleQueue[tuple[int, object]] = queue.SimpleQueue()
        count: queue.Queue[int] = queue.Queue()
        count.put(i)  # the per-file function marks itself done on this queue
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, done, count, True)
        _, result = done.get()
        if isinstance(result, Exception):
            results.put(result)
            return
        written[i] = result  # this file's WriteResults
    results.put(written)


def in_process_save_strategy() -> TorchDistSaveShardedStrategy:
    """Megatron's ``torch_dist`` save strategy (format 1, as ``dist_checkpointing.save``
    picks by default) whose files are written by this process, one file per rank."""
    from megatron.core.dist_checkpointing.strategies import (
        filesystem_async,  # lazy: megatron-core takes seconds to import; only a save needs it
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,  # lazy: megatron-core takes seconds to import; only a save needs it
    )

    # The writer takes its results queue from this module global, creating a Manager process
    # on first use; an in-process queue serves a write that stays in the process.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            request = self.async_save(sharded_state_dict, checkpoint_dir)
            if request.async_fn is not None:  # partial(write_preloaded_data_multiproc, transforms, msc)
                bound = request.async_fn.args
                request = request._replace(async_fn=lambda *args: _write_buckets(*bound, *args))
            request.execute_sync()

    return InProcessTorchDistSave("torch_dist", 1, thread_count=1)


def space_problem(folder: Path, needed: int) -> str | None:
    """Why ``needed`` bytes cannot be written under ``folder`` (its filesystem's free space, or
    this process's file-size limit), or None if they can."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and needed > soft:
        return f"needs about {needed:,} bytes in one file, over the file-size limit (ulimit -f) of {soft:,} bytes"
    if needed > free:
        return f"needs about {needed:,} bytes, {free:,} bytes free on its filesystem"
    return None


def out_of_space(err: BaseException, folder: Path, needed: int) -> str | None:
    """Why a write under ``folder`` failed with ``err`` if space is the reason, else None: an
    ``ENOSPC`` / ``EDQUOT`` / ``EFBIG`` anywhere in its chain, or (the zip writer drops the errno)
    ``needed`` bytes that :func:`space_problem` says do not fit."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _SPACE_ERRNOS:
            return space_problem(folder, needed) or f"{cause.strerror or cause} ({_free(folder)})"
        cause = cause.__cause__ or cause.__context__
    return space_problem(folder, needed)


def _free(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free:,} bytes free on its filesystem"
    except OSError:
        return "free space unknown"
