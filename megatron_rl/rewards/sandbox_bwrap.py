"""The bubblewrap backend of the code sandbox: the ``bwrap`` command line that runs one program.

:func:`bwrap_argv` builds ``bwrap [namespaces, mounts] -- env -i ENV prlimit LIMITS -- setpriv
DROP -- argv``: bubblewrap makes the namespaces and the sandbox's file system (what it holds is
listed in :mod:`megatron_rl.rewards.sandbox`'s docstring), ``env -i`` leaves exactly the promised
environment, ``prlimit`` sets the rlimits and, as root, ``setpriv`` drops to the leased uid with no
capabilities and ``no_new_privs`` (two tiny exec's, ~2 ms). A non-root caller gets a user
namespace instead of a uid of its own.

It only builds the command: :func:`~megatron_rl.rewards.sandbox.run_sandboxed` leases the uid,
computes the limits, runs the command and classifies how it ended.
"""

from __future__ import annotations

import os

from megatron_rl.rewards.sandbox_plain import ETC_FILES, ROOT_LINKS

__all__ = ["bwrap_argv"]


def bwrap_argv(
    argv: list[str],
    workdir: str,
    ro_paths: list[str],
    limits: dict[str, tuple[int, int]],
    uid: int | None,
    memory_mb: int,
    env: dict[str, str],
) -> list[str]:
    """bwrap [namespaces, mounts] -- env -i ENV prlimit LIMITS -- setpriv DROP -- argv."""
    tmpfs_size = str(memory_mb << 20)
    cmd = [
        "bwrap",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    if uid is None:
        cmd.append("--unshare-user")  # not root: bwrap needs a user namespace to mount
    else:
        # Root without a user namespace keeps the leased uid real on the host (a user namespace
        # made by root would map the program back to host root, where RLIMIT_NPROC is ignored).
        # setpriv needs SETUID/SETGID and SETPCAP (bounding set); setuid() then clears them all.
        cmd += [
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            "--cap-add",
            "CAP_SETPCAP",
        ]
    for link in ROOT_LINKS:
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            cmd += ["--ro-bind", link, link]
    # bwrap would create /etc with mode 0700, where the dropped uid could not reach the loader
    # cache or /etc/alternatives.
    cmd += ["--perms", "0755", "--dir", "/etc"]
    for path in ETC_FILES:
        cmd += ["--ro-bind-try", path, path]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    for tmp in ("/tmp", "/dev/shm"):
        cmd += ["--perms", "1777", "--size", tmpfs_size, "--tmpfs", tmp]
    # bwrap would create the missing parents of a bind target with mode 0700, which the
    # dropped uid could not traverse: create them first, world-searchable.
    for parent in _missing_parents([*ro_paths, workdir]):
        cmd += ["--perms", "0755", "--dir", parent]
    for path in ro_paths:
        cmd += ["--ro-bind", path, path]
    cmd += ["--bind", workdir, workdir, "--chdir", workdir, "--"]
    # bwrap adds PWD to the environment; env -i leaves exactly the three variables we promise.
    cmd += ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items())]
    cmd += ["/usr/bin/prlimit", *(f"--{name.lower()}={s}:{h}" for name, (s, h) in limits.items())]
    if uid is not None:
        cmd += [
            "--",
            "/usr/bin/setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ]
    return cmd + ["--", *argv]


def _missing_parents(targets: list[str]) -> list[str]:
    """Ancestors of ``targets`` that the bwrap root lacks (outside /usr, /tmp's own mount point,
    /dev, /proc and the targets themselves), parents before children."""
    made = {"/", "/usr", "/etc", "/tmp", "/dev", "/dev/shm", "/proc", *ROOT_LINKS}
    out: list[str] = []
    for target in targets:
        parts = target.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:i])
            inside_target = any((parent + "/").startswith(t + "/") for t in targets)
            if parent in made or parent.startswith("/usr/") or inside_target:
                continue
            made.add(parent)
            out.append(parent)
    return out
