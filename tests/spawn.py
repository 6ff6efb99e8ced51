"""Start N ranks in a real gloo process group for a test and collect what each returns.

    results = run_ranks(fn, world_size=2, args=(x,))

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by name into
spawned processes). Its return value must be picklable. A failure on any rank raises in the test
with that rank's traceback; a hang is cut at ``timeout`` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback


def _entry(fn, rank, world_size, init_file, results, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
            # Every rank leaves its last collective before any tears the group down: a rank that
            # destroys its gloo pairs early resets the connections of a slower peer.
            dist.barrier()
            # Pickled by value here: through the queue, torch would share a tensor's storage by
            # a file descriptor that the parent can only fetch while this process still lives.
            results.put((rank, "ok", pickle.dumps(value)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="gloo-init-")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, init_file, results, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                value = pickle.loads(value)
            out[rank] = value
    except queue.Empty:
        errors.append(f"timed out after {timeout}s; ranks that answered: {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
