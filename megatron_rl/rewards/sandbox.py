"""Run one untrusted program under limits, in namespaces, as a throwaway user.

``run_sandboxed(argv, stdin=..., workdir=..., ...)`` starts ``argv`` with ``stdin`` on its standard
input and ``workdir`` as its current directory, waits at most ``timeout_s`` (wall clock), and
returns a :class:`SandboxResult`: the exit code (``-N`` when killed by signal N), the captured
stdout/stderr (stdout capped at ``output_limit_bytes``) and a ``status`` among :data:`STATUSES`.

Two modes, chosen by ``mode`` ("auto" takes bubblewrap when ``bwrap`` is on PATH):

``bwrap`` (:mod:`~megatron_rl.rewards.sandbox_bwrap`)
    ``bwrap`` builds a new mount, pid, network, IPC, UTS (and cgroup) namespace whose file system
    holds only read-only ``/usr`` (with the ``/bin``, ``/lib*`` links), a few loader files of
    ``/etc``, the running interpreter's prefixes, the caller's ``extra_ro_paths``, a fresh
    ``/proc`` and minimal ``/dev``, size-capped tmpfs ``/tmp`` and ``/dev/shm``, and ``workdir``
    read-write.  Inside, ``prlimit`` sets the rlimits and ``setpriv`` drops to the leased uid with
    no capabilities and ``no_new_privs`` before exec'ing ``argv`` (two tiny exec's, ~2 ms).
``plain`` (:mod:`~megatron_rl.rewards.sandbox_plain`)
    No bubblewrap: a launcher (``python -I -S sandbox_plain.py``) unshares the same namespaces
    (mount, pid, net, IPC, UTS), builds the same root as bwrap does on a small tmpfs (the same
    allowlist: ``/usr`` and its links, the loader's files of ``/etc``, the read-only paths,
    ``workdir``, a fresh ``/proc``, minimal ``/dev``, size-capped ``/tmp`` and ``/dev/shm``),
    ``pivot_root``'s into it and detaches the host's tree, and forks the program as pid 2 under
    the same rlimits and uid drop.  Needs root.

Both modes, as root (the CI case): the program runs as a uid/gid leased for this one run from
``UID_BASE`` .. ``UID_BASE + UID_COUNT - 1`` (:mod:`~megatron_rl.rewards.sandbox_uids`: an
``flock`` per uid, so concurrent sandboxes in any process on the host never share one), which
makes ``RLIMIT_NPROC`` count this sandbox's processes only and keeps one sandbox from signalling
another.  ``workdir`` is chown'ed to it.  A non-root
caller can only use bwrap (it then adds a user namespace) and runs the program as itself.

What it protects against:
  - network access of any kind: the new network namespace has no interface but its own loopback
    (down in plain mode; up in bwrap mode, which always configures it, but private to the
    sandbox), so the host's 127.0.0.1 services and abstract unix sockets are unreachable;
  - reading or writing the host's files: both modes show only the paths above (the rest of the
    host's file system is absent, not merely unreadable); writes can land only
    in ``workdir`` and the private, size-capped tmpfs mounts, which vanish with the sandbox;
  - the caller's environment: the program sees only ``PATH=/usr/bin:/bin``, ``LANG=C.UTF-8`` and
    ``HOME=<workdir>``;
  - fork bombs and thread bombs (``RLIMIT_NPROC``), memory hogs (``RLIMIT_AS``), CPU spinning
    (``RLIMIT_CPU`` and the wall clock), huge output (stdout/stderr read with a cap, then killed)
    and huge files (``RLIMIT_FSIZE``), core dumps (``RLIMIT_CORE`` 0), fd exhaustion
    (``RLIMIT_NOFILE``);
  - processes that outlive the run: the program is not pid 1 but lives in its own pid namespace,
    so when it ends, or when the sandbox is killed at the deadline, the kernel kills every process
    in the namespace, setsid double-fork daemons included; after a kill, every process of the
    leased uid is also killed before the uid is handed out again;
  - privilege: no capabilities, ``no_new_privs`` (setuid binaries do not elevate), a uid that
    owns nothing on the host, so it cannot signal or ptrace the verifier or other sandboxes;
  - the caller's own lifetime: if the verifier process dies, the sandbox dies with it
    (``--die-with-parent`` / ``PR_SET_PDEATHSIG``).

What it does NOT protect against:
  - kernel exploits: the program shares the host kernel (no seccomp filter, no VM);
  - side channels (timing, cache, Spectre-class) and CPU / memory-bandwidth contention with other
    work on the host; ``RLIMIT_AS`` bounds address space, not page-cache or kernel memory;
  - disk usage in ``workdir`` beyond ``RLIMIT_FSIZE`` per file (many files can fill the disk
    holding ``workdir``); put temporary roots on a size-limited file system if that matters;
  - information in ``/proc`` and ``/sys`` that is global to the host (CPU, memory, kernel version,
    mounts);
  - a non-root caller in bwrap mode gets no uid of its own: the program runs as the caller (inside
    a user namespace), so the no-survivor sweep after a kill is skipped;
  - exit codes above 128: bubblewrap reports death by signal N as exit 128+N, so a program that
    exits with 137 on purpose reads as killed by SIGKILL (still a failure, never ``ok``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.rewards.sandbox_bwrap import bwrap_argv
from megatron_rl.rewards.sandbox_plain import plain_argv
from megatron_rl.rewards.sandbox_uids import UidLease, kill_uid

log = logging.getLogger(__name__)

__all__ = ["STATUSES", "SandboxResult", "resolve_mode", "run_sandboxed", "sandbox_problem"]

#: Values of :attr:`SandboxResult.status`.
STATUSES = ("ok", "exit_nonzero", "timeout", "memory", "output_limit", "signal", "sandbox_error")

STARTUP_ALLOWANCE_S = 0.5  # wall-clock slack for creating the namespaces and exec'ing
STDERR_KEEP = 64 * 1024  # stderr bytes kept from the start and from the end
NOFILE = 512
# A process killed by SIGKILL/SIGSEGV/SIGABRT/SIGBUS with a peak RSS above this share of the
# address-space limit most likely died of the limit (malloc returned NULL and was dereferenced).
MEMORY_RSS_SHARE = 0.8
_MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory")
_FILE_TOO_LARGE = b"[Errno 27] File too large"  # Python ignores SIGXFSZ and raises instead
_CLEAN_PATH = "/usr/bin:/bin"


@dataclass
class SandboxResult:
    """What one sandboxed run produced. ``returncode`` is the exit code, or ``-N`` for signal N
    (``-9`` when the sandbox killed it at the deadline or the output cap)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    status: str  # one of STATUSES
    detail: str = ""  # why, for logs (the limit that was hit, the sandbox's own error)
    wall_s: float = 0.0  # wall-clock seconds from start to reap
    # Measured in plain mode only (bubblewrap's init does not pass its child's usage on): CPU
    # seconds (user+system) of the program and its reaped children, and its peak resident set.
    cpu_s: float | None = None
    peak_rss_mb: float | None = None


def resolve_mode(mode: str) -> str:
    """Map "auto" to "bwrap" when bubblewrap is installed, else "plain"; check the name."""
    if mode not in ("auto", "bwrap", "plain"):
        raise ValueError(f"sandbox mode must be 'auto', 'bwrap' or 'plain', got {mode!r}")
    if mode == "auto":
        chosen = "bwrap" if shutil.which("bwrap") else "plain"
        if chosen not in _AUTO_LOGGED:
            _AUTO_LOGGED.add(chosen)
            why = "bubblewrap is on PATH" if chosen == "bwrap" else "bubblewrap is not installed"
            log.info("code sandbox: %s mode (%s)", chosen, why)
        return chosen
    return mode


_AUTO_LOGGED: set[str] = set()


def sandbox_problem(mode: str = "auto") -> str | None:
    """None when ``mode`` can run programs here, else why not (checked once per process by
    running ``/bin/true`` in it)."""
    mode = resolve_mode(mode)
    if mode not in _SELF_TEST:
        _SELF_TEST[mode] = _self_test(mode)
    return _SELF_TEST[mode]


_SELF_TEST: dict[str, str | None] = {}


def _self_test(mode: str) -> str | None:
    if mode == "bwrap" and not shutil.which("bwrap"):
        return "bwrap mode: bubblewrap is not installed (apt-get install bubblewrap)"
    if mode == "plain" and os.geteuid() != 0:
        return "plain mode needs root (it creates namespaces and drops to a leased uid)"
    with tempfile.TemporaryDirectory(prefix="megatron-rl-sbtest-") as root:
        work = os.path.join(root, "w")
        os.mkdir(work)
        res = _run(
            ["/bin/true"],
            stdin=b"",
            workdir=work,
            timeout_s=10.0,
            memory_mb=256,
            output_limit_bytes=1 << 16,
            max_processes=8,
            mode=mode,
            extra_ro_paths=(),
        )
    if res.status != "ok":
        why = (res.detail or res.stderr.decode(errors="replace")).strip()
        return f"{mode} sandbox does not work here (exit {res.returncode}): {why[:500]}"
    return None


def run_sandboxed(
    argv: list[str],
    *,
    stdin: bytes,
    workdir: str,
    timeout_s: float,
    memory_mb: int,
    output_limit_bytes: int,
    max_processes: int,
    mode: str = "auto",
    extra_ro_paths: Sequence[str] = (),
) -> SandboxResult:
    """Run ``argv`` in the sandbox (see the module docstring) and classify how it ended.

    ``workdir`` must exist; it is the program's cwd and HOME and its only writable host
    directory (the caller creates a fresh one per run and deletes it after). ``argv[0]`` is
    looked up on ``PATH=/usr/bin:/bin`` unless absolute; it and its files must be under ``/usr``,
    the interpreter prefixes, ``workdir`` or ``extra_ro_paths``. Limits: ``timeout_s`` wall clock
    (plus ``STARTUP_ALLOWANCE_S``) and ceil(timeout_s)+1 s of CPU per process, ``memory_mb`` of
    address space per process, ``output_limit_bytes`` of stdout (and of stderr, and per written
    file), ``max_processes`` processes+threads in all. Never raises for the program's behaviour;
    a sandbox that cannot be set up gives status ``sandbox_error``.
    """
    try:
        mode = resolve_mode(mode)
    except ValueError as e:
        return SandboxResult(-1, b"", b"", "sandbox_error", str(e))
    missing = [p for p in [workdir, *extra_ro_paths] if not os.path.exists(p)]
    if missing:
        return SandboxResult(-1, b"", b"", "sandbox_error", f"path does not exist: {missing[0]}")
    problem = sandbox_problem(mode)
    if problem:
        return SandboxResult(-1, b"", b"", "sandbox_error", problem)
    return _run(
        argv,
        stdin=stdin,
        workdir=workdir,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        output_limit_bytes=output_limit_bytes,
        max_processes=max_processes,
        mode=mode,
        extra_ro_paths=extra_ro_paths,
    )


def _run(
    argv: list[str],
    *,
    stdin: bytes,
    workdir: str,
    timeout_s: float,
    memory_mb: int,
    output_limit_bytes: int,
    max_processes: int,
    mode: str,
    extra_ro_paths: Sequence[str],
) -> SandboxResult:
    workdir = os.path.realpath(workdir)
    ro_paths = _ro_paths(extra_ro_paths)
    missing = [p for p in [workdir, *ro_paths] if not os.path.exists(p)]
    if missing:
        return SandboxResult(-1, b"", b"", "sandbox_error", f"path does not exist: {missing[0]}")
    cpu_soft = math.ceil(timeout_s) + 1
    limits = _rlimits(cpu_soft, memory_mb, output_limit_bytes, max_processes)
    with UidLease() as uid:
        if uid is not None:
            os.chown(workdir, uid, uid)
            # bwrap enters it as root without CAP_DAC_OVERRIDE: it needs the search bit.
            os.chmod(workdir, os.stat(workdir).st_mode & 0o7777 | 0o711)
        env = {"PATH": _CLEAN_PATH, "LANG": "C.UTF-8", "HOME": workdir}
        # The plain launcher reports setup errors on a pipe the program never holds; bwrap's
        # children would pass any fd on to the program, so bwrap mode gets none.
        status_r, status_w = os.pipe()
        try:
            if mode == "bwrap":
                cmd = bwrap_argv(argv, workdir, ro_paths, limits, uid, memory_mb, env)
                pass_fds: tuple[int, ...] = ()
            else:
                cmd = plain_argv(argv, workdir, ro_paths, limits, uid, memory_mb, status_w)
                pass_fds = (status_w,)
            res = _spawn_and_wait(
                cmd, env, stdin, timeout_s + STARTUP_ALLOWANCE_S, output_limit_bytes, pass_fds, uid
            )
            os.close(status_w)
            status_w = -1
            report = _read_report(status_r)
        finally:
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
    if "error" in report:
        return SandboxResult(-1, res.stdout, res.stderr, "sandbox_error", report["error"], res.wall_s)
    if res.status == "sandbox_error":
        return res
    res.cpu_s, res.peak_rss_mb = report.get("cpu_s"), report.get("peak_rss_mb")
    if not res.status:  # not already cut at the deadline or the output cap
        res.status, res.detail = _classify(res, cpu_soft, memory_mb)
    return res


def _ro_paths(extra: Sequence[str]) -> list[str]:
    """The interpreter's prefixes (for Python programs and the plain-mode launcher) plus the
    caller's paths, resolved and without duplicates or paths already under /usr."""
    want = [sys.prefix, sys.base_prefix, *extra]
    out: list[str] = []
    for p in want:
        rp = os.path.realpath(p)
        if rp not in out and not (rp + "/").startswith("/usr/"):
            out.append(rp)
    return out


def _rlimits(
    cpu_soft: int, memory_mb: int, output_limit_bytes: int, max_processes: int
) -> dict[str, tuple[int, int]]:
    """name -> (soft, hard), each clamped to our own hard limit: lowering is always allowed,
    raising the hard limit is not once capabilities are gone."""
    want = {
        "AS": (memory_mb << 20, memory_mb << 20),
        "CPU": (cpu_soft, cpu_soft + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        "FSIZE": (output_limit_bytes, output_limit_bytes),
        "NPROC": (max_processes, max_processes),
        "CORE": (0, 0),
        "NOFILE": (NOFILE, NOFILE),
    }
    out = {}
    for name, (soft, hard) in want.items():
        cur_hard = resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))[1]
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        out[name] = (soft, hard)
    return out


def _spawn_and_wait(
    cmd: list[str],
    env: dict[str, str],
    stdin: bytes,
    wall_s: float,
    output_limit: int,
    pass_fds: tuple[int, ...],
    uid: int | None,
) -> SandboxResult:
    """Start ``cmd`` in a new session, pump its output under the caps until it exits or the
    deadline passes, kill the whole sandbox if needed, and reap it with its resource usage."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: no writer thread needed
        stdin_file.write(stdin)
        stdin_file.seek(0)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        except OSError as e:
            return SandboxResult(-1, b"", b"", "sandbox_error", f"cannot start {cmd[0]}: {e}")
    assert proc.stdout is not None and proc.stderr is not None  # both are PIPEs (above)
    try:
        out, err, killed_for = _pump(proc, start + wall_s, output_limit)
    finally:
        proc.stdout.close()
        proc.stderr.close()
        if proc.returncode is None:  # still running (deadline, output cap, or an exception here)
            _kill_group(proc.pid)
            proc.wait()
    if killed_for and uid is not None:
        kill_uid(uid)  # the namespace dies with its init; this makes sure before the lease ends
    code = proc.returncode
    if 128 < code <= 128 + 64:  # bwrap and the plain launcher report death by signal N as 128+N
        code = 128 - code
    detail = {
        "timeout": f"killed after {wall_s:.1f} s wall clock",
        "output_limit": f"output exceeded {output_limit} bytes",
    }.get(killed_for or "", "")
    return SandboxResult(
        code if not killed_for else -signal.SIGKILL,
        out,
        err,
        killed_for or "",
        detail,
        time.monotonic() - start,
    )


def _pump(
    proc: subprocess.Popen[bytes], deadline: float, output_limit: int
) -> tuple[bytes, bytes, str | None]:
    """Read stdout/stderr until both close and ``proc`` has exited (and is reaped). Returns
    (stdout, stderr, None), or what was read with "timeout" / "output_limit" when a cap was hit
    (``proc`` then still runs)."""
    sel = selectors.DefaultSelector()
    out, err = bytearray(), bytearray()
    err_total = 0
    assert proc.stdout is not None and proc.stderr is not None  # the caller opens both as PIPEs
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    try:  # readable when the process exits; without it, poll every 20 ms
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            if proc.returncode is None and proc.poll() is not None and pidfd is not None:
                sel.unregister(pidfd)
            streams_open = any(k.data != "exit" for k in sel.get_map().values())
            if proc.returncode is not None and not streams_open:
                return bytes(out), _trim(err), None
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), _trim(err), "timeout"
            for key, _ in sel.select(left if pidfd is not None else min(left, 0.02)):
                if key.data == "exit":
                    continue  # poll() above reaps it
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "out":
                    out += chunk
                else:
                    err_total += len(chunk)
                    err += chunk
                    if len(err) > 4 * STDERR_KEEP:  # keep the head and the latest tail
                        err[:] = err[:STDERR_KEEP] + b"\n[...]\n" + err[-STDERR_KEEP:]
                if len(out) > output_limit or err_total > output_limit:
                    return bytes(out[:output_limit]), _trim(err), "output_limit"
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)


def _trim(err: bytearray) -> bytes:
    if len(err) > 2 * STDERR_KEEP + 16:
        return bytes(err[:STDERR_KEEP] + b"\n[...]\n" + err[-STDERR_KEEP:])
    return bytes(err)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_report(fd: int) -> dict:
    """What the plain launcher wrote on its status pipe: JSON lines, merged into one dict
    ({"error": msg} or {"cpu_s": .., "peak_rss_mb": ..}). Non-blocking: after a kill, a dying
    writer must not hold us up."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    report: dict = {}
    for line in b"".join(chunks).splitlines():
        try:
            report.update(json.loads(line))
        except ValueError:
            report["error"] = f"garbled launcher report: {line[:200]!r}"
    return report


def _classify(res: SandboxResult, cpu_soft: int, memory_mb: int) -> tuple[str, str]:
    """(status, detail) of a run that was not cut by the sandbox itself."""
    sig = -res.returncode if res.returncode < 0 else 0
    if res.returncode == 0:
        return "ok", ""
    if sig == signal.SIGXCPU or (res.cpu_s or 0.0) >= cpu_soft:
        return "timeout", f"CPU limit of {cpu_soft} s reached"
    if sig == signal.SIGXFSZ or _FILE_TOO_LARGE in res.stderr:
        return "output_limit", "file size limit reached"
    tail = res.stderr[-4096:]
    if any(m in tail for m in _MEMORY_MARKERS):
        return "memory", f"out of memory (limit {memory_mb} MB)"
    near_limit = (res.peak_rss_mb or 0.0) >= MEMORY_RSS_SHARE * memory_mb
    if sig in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) and near_limit:
        return "memory", f"killed by signal {sig} at {res.peak_rss_mb:.0f} MB (limit {memory_mb})"
    if sig:
        return "signal", f"killed by signal {sig} ({signal.Signals(sig).name})"
    return "exit_nonzero", f"exit code {res.returncode}"
