"""The code sandbox's throwaway users: a uid/gid leased for one run, and the sweep of its leftovers.

As root, every sandboxed program runs as a uid/gid leased from ``UID_BASE`` ..
``UID_BASE + UID_COUNT - 1`` for that one run (:class:`UidLease`: an ``flock`` per uid under
``LEASE_DIR``, so concurrent sandboxes in any process on the host never share one). That makes
``RLIMIT_NPROC`` count this sandbox's processes only, keeps one sandbox from signalling another,
and lets :func:`kill_uid` kill exactly the sandbox's leftovers after a kill, before the uid is
handed out again. A non-root caller gets no lease (``None``): the program runs as the caller.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import random
import signal
import time

__all__ = ["LEASE_DIR", "UID_BASE", "UID_COUNT", "UidLease", "kill_uid"]

UID_BASE = 64000  # leased uids/gids: no Debian package or login user lives in 64000-64511
UID_COUNT = 512
LEASE_DIR = "/tmp/megatron-rl-sandbox-uids"  # fixed (not $TMPDIR): every process must agree


class UidLease:
    """Context manager yielding a uid no other sandbox on this host holds (None when not root).

    One lock file per uid under ``LEASE_DIR``; ``flock`` is per open file description, so threads
    of one process exclude each other too, and a crashed holder's lock is released by the kernel.
    """

    def __init__(self) -> None:
        self._fd = -1
        self.uid: int | None = None

    def __enter__(self) -> int | None:
        if os.geteuid() != 0:
            return None
        _ensure_lease_dir()
        start = random.randrange(UID_COUNT)
        for i in range(UID_COUNT):
            uid = UID_BASE + (start + i) % UID_COUNT
            if _uid_exists(uid):
                continue
            fd = os.open(os.path.join(LEASE_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._fd, self.uid = fd, uid
            return uid
        raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use")

    def __exit__(self, *exc) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock


def _ensure_lease_dir() -> None:
    try:
        os.mkdir(LEASE_DIR, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(LEASE_DIR)
    if st.st_uid != 0 or not os.path.isdir(LEASE_DIR) or os.path.islink(LEASE_DIR):
        raise RuntimeError(f"{LEASE_DIR} must be a directory owned by root")


def _uid_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def kill_uid(uid: int, limit_s: float = 5.0) -> None:
    """SIGKILL every process whose real uid is ``uid`` until none is left (``limit_s`` at most):
    the leased uid belongs to this run only, so this is exactly the sandbox's leftovers."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    real_uid = next(int(line.split()[1]) for line in f if line.startswith(b"Uid:"))
                if real_uid == uid:
                    found = True
                    os.kill(int(name), signal.SIGKILL)
            except (OSError, StopIteration, ValueError):
                continue  # gone meanwhile
        if not found:
            return
        time.sleep(0.01)
