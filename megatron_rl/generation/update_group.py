"""The weight-update process group between one trainer rank and the generation servers.

It is a group of its own, outside the trainer's ``torch.distributed`` world and outside each
server's, built exactly the way SGLang builds it (``init_custom_process_group`` in
``sglang/srt/utils/common.py``, 0.5.23): a ``tcp://`` rendezvous whose store rank 0 (the trainer)
hosts, a ``PrefixStore`` named after the group, and ``_new_process_group_helper``. Building it the
same way is what lets our broadcaster talk to real SGLang servers and to the built-in engine
alike: rank 0 is the trainer, a server with ``rank_offset`` r and ``tp`` workers takes ranks
``r .. r + tp - 1``. Backends: ``nccl`` on GPUs, ``gloo`` on CPU.

One difference: rank 0's store listens on ``master_address`` only. torch's ``TCPStore`` server
binds every interface (``::``) whatever host it is given, which opens the rendezvous (and with it
a seat in the group that broadcasts the weights) to anyone who can reach the trainer's host; here
rank 0 binds the listening socket itself and hands it to the store (``master_listen_fd``).

A joining rank (rank > 0) first checks that rank 0's store answers at all: a TCP connection to
``master_address:master_port`` within ``connect_timeout_s`` (retried, since a caller may start its
store just after it asked the servers to join), else a :class:`ConnectionError` naming that
address. Without it a wrong master address surfaced after 205 s, as torch's connect timeout
message: the store client retries its connect, with backoff, for the whole ``timeout_s`` (120 s)
and overshoots it by up to one more backoff and attempt.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "broadcast",
    "destroy_update_group",
    "init_update_group",
    "listen",
    "probe_master",
]

# How long a joining rank waits for rank 0's store to accept a connection. Our trainer listens
# before it asks the servers to join (weight_sync.broadcast), so its store answers at once; the
# margin is for callers that start their store just after asking (SGLang's own pattern), and it
# matches the fleet client's HTTP connect timeout.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Between two connect attempts to a master that refused: short against the timeout above.
_PROBE_RETRY_S = 0.1


def init_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 120.0,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    listen_fd: int | None = None,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the group; blocks until all ``world_size`` ranks joined
    (``timeout_s`` at most).

    ``connect_timeout_s`` (rank > 0): how long rank 0's store may take to accept a connection;
    past it a :class:`ConnectionError` naming ``master_address:master_port`` (:func:`probe_master`).
    ``listen_fd`` (rank 0): a socket already listening on ``master_port`` (:func:`listen`), so
    that the port the other ranks were told is held from the moment it was chosen; the store
    takes it over. Without it rank 0 binds ``master_port`` here."""
    from torch.distributed.distributed_c10d import (  # lazy: private torch API, used only to build the group
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    if not group_name:
        raise ValueError("group_name: must not be empty")
    if not (connect_timeout_s > 0 and timeout_s > 0):
        raise ValueError(f"timeout_s, connect_timeout_s: must be > 0, got {timeout_s}, {connect_timeout_s}")
    timeout = timedelta(seconds=timeout_s)
    connect_s = min(connect_timeout_s, timeout_s)  # the connect is part of the whole join
    if rank > 0:
        probe_master(master_address, int(master_port), connect_s)
    # What SGLang's tcp:// rendezvous builds, made directly: under torchrun the rendezvous would
    # reuse the elastic agent's store (TORCHELASTIC_USE_AGENT_STORE) and rank 0 would wait for
    # a master that never comes. Here rank 0 always hosts the group's own store.
    tcp_store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        # A joining rank's connect is bounded by connect_timeout_s too (the master could go
        # between the probe and here); the store's operations get the whole timeout after.
        timeout=timeout if rank == 0 else timedelta(seconds=connect_s),
        wait_for_workers=False,
        master_listen_fd=(
            (listen_fd if listen_fd is not None else listen(master_address, int(master_port))[0])
            if rank == 0
            else None
        ),
    )
    tcp_store.set_timeout(timeout)
    store = PrefixStore(group_name, tcp_store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        # GroupName is NewType("GroupName", str) in torch's stubs: at run time the str itself.
        group_name=cast("GroupName", group_name),
        backend_options=None,
        timeout=timeout,
    )
    # Group ranks are the ranks given here (no default world to translate from).
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def probe_master(host: str, port: int, timeout_s: float) -> None:
    """Return once a TCP connection to ``host:port`` opens (it is closed at once: a store drops a
    client that says nothing); retry a refused one for ``timeout_s`` at most, then raise a
    :class:`ConnectionError` that names ``host:port`` and the last reason."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=left):
                return
        except OSError as e:  # refused, unreachable, timed out: rank 0 may not listen yet
            last = e
        time.sleep(min(_PROBE_RETRY_S, max(0.0, deadline - time.monotonic())))
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    reason = (last.strerror or str(last) or type(last).__name__) if last is not None else "no attempt"
    raise ConnectionError(
        f"master_address:master_port: nothing accepted a connection at {where} within {timeout_s:g} s "
        f"({reason}): is master_address the trainer's address as this host reaches it, and "
        "master_port the port its update group listens on?"
    )


def listen(host: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on ``host:port`` only (its first address; port 0: one the system
    picks), as a bare descriptor, and its port.

    The store owns the descriptor once it is given to :func:`init_update_group`: its libuv server
    closes it when the store goes (with the group), so the Python socket object lets go of it
    (``detach``) instead of closing. Binding first and telling the port after is what keeps two
    groups on one host from picking the same free port (a pick, then a bind, races).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"master_address: cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        bound = int(sock.getsockname()[1])
    except OSError as e:
        sock.close()
        raise RuntimeError(f"master_address: cannot listen on {host}:{port}: {e}") from None
    return sock.detach(), bound


def destroy_update_group(group: dist.ProcessGroup) -> None:
    """Tear the group down (no-op if it is already gone)."""
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, KeyError):
        pass


def broadcast(tensor: torch.Tensor, group: dist.ProcessGroup, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from group rank ``src`` to every rank of ``group``."""
    dist.broadcast(tensor, src=src, group=group)
