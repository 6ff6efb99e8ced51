"""The plain backend of the code sandbox: namespaces, mounts, rlimits and the uid drop without
bubblewrap (root only).

:func:`plain_argv` gives the command that re-runs this module as a launcher
(``python -I -S sandbox_plain.py SPEC``, ~70 ms); what the launcher mounts and hides is listed in
:mod:`megatron_rl.rewards.sandbox`'s docstring. Process tree: L (host pid namespace: unshares the
namespaces, waits) -> C (pid 1 of the new namespace: mounts, reaps, exits with the program, which
makes the kernel kill whatever is left in it) -> P (pid 2: drops to the leased uid, sets the
rlimits, exec's the program). Setup errors, and the program's CPU time and peak RSS, go to the
status fd as JSON lines; the program never holds that fd (close-on-exec), so it cannot fake a
sandbox error. :func:`~megatron_rl.rewards.sandbox.run_sandboxed` runs the command and reads the
report.

Only the standard library may be imported here: the launcher runs isolated (``-I -S``), without
site-packages and without megatron_rl on its path.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import select
import signal
import sys

__all__ = ["DEVICES", "ETC_FILES", "ROOT_LINKS", "plain_argv"]

#: What the sandbox's root holds besides /usr, the read-only paths and the workdir, in both
#: backends: the loader's files of /etc, the root-level links into /usr, the devices of /dev.
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
)
ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_LAUNCH_FAILED = 125


def plain_argv(
    argv: list[str],
    workdir: str,
    ro_paths: list[str],
    limits: dict[str, tuple[int, int]],
    uid: int | None,
    memory_mb: int,
    status_fd: int,
) -> list[str]:
    """``python -I -S sandbox_plain.py SPEC``: this module as the launcher, with the run's spec as
    JSON; setup errors and the program's usage come back as JSON lines on ``status_fd``."""
    spec = {
        "argv": argv,
        "workdir": workdir,
        "ro_paths": ro_paths,
        "limits": limits,
        "uid": uid,
        "tmpfs_size": memory_mb << 20,
        "status_fd": status_fd,
        "parent_pid": os.getpid(),
    }
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)]


class _LaunchError(Exception):
    pass


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name)
    if fn(*args) != 0:
        e = ctypes.get_errno()
        raise _LaunchError(f"{name}{args!r}: {os.strerror(e)} (errno {errno.errorcode.get(e)})")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _libc_call("mount", enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _launcher_main(spec: dict) -> None:
    """L: die with the caller, unshare the namespaces, fork C and exit with its exit code."""
    status_fd = spec["status_fd"]
    try:
        _libc_call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != spec["parent_pid"]:
            os._exit(_LAUNCH_FAILED)  # the caller died before we armed PDEATHSIG
        _libc_call("unshare", _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS)
        alive_r, alive_w = os.pipe()  # C sees EOF on alive_r once L is gone
        pid = os.fork()
    except (_LaunchError, OSError) as e:
        _report(status_fd, error=f"sandbox launcher: {e}")
        os._exit(_LAUNCH_FAILED)
    if pid == 0:
        os.close(alive_w)
        _init_main(spec, alive_r)
    os.close(alive_r)
    os.close(status_fd)  # only C and P may still report
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def _init_main(spec: dict, alive_r: int) -> None:
    """C, pid 1 of the new pid namespace: set up the mounts, fork P, reap every orphan until P
    ends, then exit (which makes the kernel kill whatever is left in the namespace)."""
    status_fd = spec["status_fd"]
    try:
        _libc_call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if _readable(alive_r):
            os._exit(_LAUNCH_FAILED)  # L died before PDEATHSIG was armed
        os.close(alive_r)
        _plain_mounts(spec)
        _libc_call("sethostname", b"sandbox", 7)
        pid = os.fork()
    except (_LaunchError, OSError) as e:
        _report(status_fd, error=f"sandbox init: {e}")
        os._exit(_LAUNCH_FAILED)
    if pid == 0:
        _program_main(spec)
    while True:
        reaped, status, ru = os.wait4(-1, 0)
        if reaped == pid:
            _report(status_fd, cpu_s=ru.ru_utime + ru.ru_stime, peak_rss_mb=ru.ru_maxrss / 1024)
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _report(fd: int, **fields) -> None:
    os.write(fd, json.dumps(fields).encode() + b"\n")


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _plain_mounts(spec: dict) -> None:
    """Build the sandbox's root the way bubblewrap does and pivot into it: a private mount tree,
    a small tmpfs as the new root holding only the allowlist (read-only ``/usr`` and its root
    links, :data:`ETC_FILES`, the read-only paths, ``workdir`` read-write, a new ``/proc``, a
    minimal ``/dev``, size-capped ``/tmp`` and ``/dev/shm``), then ``pivot_root`` and detach the
    host's tree, so nothing else of the host's file system is reachable."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    keep = [(p, True) for p in spec["ro_paths"]] + [(spec["workdir"], False)]
    # Opened before /tmp is covered (the workdir and the read-only paths may live under it).
    fds = [(p, ro, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p, ro in keep]
    root = "/tmp"
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=0755")
    os.umask(0o022)
    tmpfs = f"size={spec['tmpfs_size']},mode=1777"
    _bind(root, "/usr", "/usr")
    for link in ROOT_LINKS:
        if os.path.islink(link):
            os.symlink(os.readlink(link), root + link)
        elif os.path.isdir(link):
            _bind(root, link, link)
    for path in ETC_FILES:
        if os.path.exists(path):
            _bind(root, path, path)
    os.mkdir(root + "/proc")
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.mkdir(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", _MS_NOSUID, "size=64k,mode=0755")
    for dev in DEVICES:
        if os.path.exists(f"/dev/{dev}"):
            open(f"{root}/dev/{dev}", "w").close()
            _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, _MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    for tmp in ("/tmp", "/dev/shm"):
        os.makedirs(root + tmp, mode=0o755, exist_ok=True)
        _mount("tmpfs", root + tmp, "tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs)
    for path, ro, fd in fds:
        _bind(root, f"/proc/self/fd/{fd}", path, writable=not ro)
        os.close(fd)
    os.chdir(root)
    _libc_call("syscall", ctypes.c_long(_pivot_root_nr()), b".", b".")
    _libc_call("umount2", b".", 2)  # MNT_DETACH: the host's tree, now stacked under ".", goes
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _bind(root: str, src: str, path: str, writable: bool = False) -> None:
    """Bind ``src`` at ``root + path`` (creating the target, parents 0755), nosuid and nodev,
    read-only unless ``writable``."""
    target = root + path
    if not os.path.lexists(target):
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.isdir(src):
            os.mkdir(target)
        else:
            open(target, "w").close()
    _mount(src, target, None, _MS_BIND | _MS_REC)
    ro = 0 if writable else _MS_RDONLY
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | ro | _MS_NOSUID | _MS_NODEV)


def _pivot_root_nr() -> int:
    machine = os.uname().machine
    if machine not in _SYS_PIVOT_ROOT:
        raise _LaunchError(f"plain mode does not know pivot_root's syscall number on {machine}")
    return _SYS_PIVOT_ROOT[machine]


def _program_main(spec: dict) -> None:
    """P: default signal handling, new session, leased uid, no new privileges, rlimits, cwd,
    exec."""
    status_fd = spec["status_fd"]
    try:
        # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: restore them,
        # or a C++ program writing past RLIMIT_FSIZE would just see EFBIG and carry on.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        if os.getpid() != 2:  # C is pid 1 of a fresh namespace; anything else is a bug here
            raise _LaunchError(f"not in a fresh pid namespace (pid {os.getpid()})")
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # clears every capability
            if 0 in os.getresuid():
                raise _LaunchError("still root after dropping privileges")
        _libc_call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        for name, (soft, hard) in spec["limits"].items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (soft, hard))
        os.chdir(spec["workdir"])
        os.set_inheritable(status_fd, False)
        os.execvpe(spec["argv"][0], spec["argv"], os.environ)
    except (_LaunchError, OSError) as e:
        _report(status_fd, error=f"sandbox exec {spec['argv'][0]!r}: {e}")
        os._exit(_LAUNCH_FAILED)


if __name__ == "__main__":
    _launcher_main(json.loads(sys.argv[1]))
