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
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["broadcast", "destroy_update_group", "init_update_group", "listen"]


def init_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 120.0,
    listen_fd: int | None = None,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the group; blocks until all ``world_size`` ranks joined.

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
    timeout = timedelta(seconds=timeout_s)
    # What SGLang's tcp:// rendezvous builds, made directly: under torchrun the rendezvous would
    # reuse the elastic agent's store (TORCHELASTIC_USE_AGENT_STORE) and rank 0 would wait for
    # a master that never comes. Here rank 0 always hosts the group's own store.
    tcp_store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=(
            (listen_fd if listen_fd is not None else listen(master_address, int(master_port))[0])
            if rank == 0
            else None
        ),
    )
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
