"""The sandbox against hostile programs, in every mode this machine can run (bwrap, plain).

Each hostile program runs for real; its result must carry the right status, and after the suite
no process carrying the suite's marker may be alive and no file carrying it may exist outside the
scratch directory. Programs receive paths and ports through ``@NAME@`` placeholders (their
environment is wiped, so that is the only channel).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest

from megatron_rl.rewards import sandbox
from megatron_rl.rewards.code import CodeConfig, compile_cpp
from megatron_rl.rewards.sandbox import run_sandboxed, sandbox_problem
from megatron_rl.rewards.sandbox_plain import ETC_FILES, ROOT_LINKS
from megatron_rl.rewards.sandbox_uids import UID_BASE, UID_COUNT

REPO = Path(__file__).resolve().parents[2]
SECRET_VAR = "MEGATRON_RL_TEST_SECRET"
IS_ROOT = os.geteuid() == 0
MODES = [
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(sandbox_problem("bwrap") is not None, reason=str(sandbox_problem("bwrap"))),
    ),
    pytest.param(
        "plain",
        marks=pytest.mark.skipif(sandbox_problem("plain") is not None, reason=str(sandbox_problem("plain"))),
    ),
]
LIMITS = dict(memory_mb=300, output_limit_bytes=4 << 20, max_processes=32)
TIMEOUT_S = 1.0  # for the programs that must time out
GENEROUS_S = 5.0  # for the others: even under the suite's own CPU load they end long before


def _py(src: str) -> str:
    return textwrap.dedent(src).lstrip()


# name -> (source, expected status). Python programs print JSON where the test checks more.
PY_HOSTILE = {
    "fork_bomb": (
        _py("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """),
        "timeout",
    ),
    "memory_hog": ("x = bytearray(10 ** 9)\n", "memory"),
    "memory_creep": ("chunks = []\nwhile True:\n    chunks.append(b'x' * 10 ** 6)\n", "memory"),
    "infinite_loop": ("while True:\n    pass\n", "timeout"),
    "sleep_forever": ("import time\ntime.sleep(60)\n", "timeout"),
    "huge_stdout": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "output_limit"),
    "huge_stderr": ("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n", "output_limit"),
    "huge_file": (
        "with open('big.bin', 'wb') as f:\n    for _ in range(100):\n        f.write(b'z' * 10 ** 6)\n",
        "output_limit",
    ),
    "recursion_error": ("def f(n):\n    return f(n + 1) + 1\nf(0)\n", "exit_nonzero"),
    "c_stack_overflow": (
        _py("""
        import sys
        sys.setrecursionlimit(10 ** 8)
        def f(n):  # recursion through map() runs on the C stack, which overflows
            return list(map(f, [n + 1]))
        f(0)
        """),
        "signal",
    ),
    "many_threads": (
        _py("""
        import threading, time
        for _ in range(500):
            threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        """),
        "exit_nonzero",
    ),
    "self_kill": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "signal"),
    "write_outside": (
        _py("""
        import json
        result = {}
        for path in json.loads('@ESCAPE_PATHS@') + ['./own-file']:
            try:
                with open(path, 'w') as f:
                    f.write('escaped')
                result[path] = 'written'
            except OSError as e:
                result[path] = type(e).__name__
        print(json.dumps(result))
        """),
        "ok",
    ),
    "fill_tmp": (
        _py("""
        n = 0
        try:
            while True:
                with open(f'/tmp/fill-@TOKEN@-{n}', 'wb') as f:
                    f.write(b'f' * (1 << 20))
                n += 1
        except OSError as e:
            print(n, type(e).__name__)
        """),
        "ok",
    ),
    "env_secrets": ("import json, os\nprint(json.dumps(dict(os.environ)))\n", "ok"),
    "network": (
        _py("""
        import json, socket
        result = {}
        # The test's own listener on the host's loopback, and TEST-NET-1 (RFC 5737: reserved,
        # never routed); in an empty network namespace no packet can leave anyway.
        for host, port in [('127.0.0.1', @PORT@), ('192.0.2.1', 80)]:
            s = socket.socket()
            s.settimeout(1.0)
            try:
                s.connect((host, port))
                result[host] = 'connected'
            except OSError as e:
                result[host] = type(e).__name__
        print(json.dumps(result))
        """),
        "ok",
    ),
    "kill_parent": (
        _py("""
        import json, os, signal
        result = {}
        for name, pid in [('parent', os.getppid()), ('everyone', -1), ('init', 1)]:
            try:
                os.kill(pid, signal.SIGKILL)
                result[name] = 'sent'
            except OSError as e:
                result[name] = type(e).__name__
        print(json.dumps(result))
        """),
        "ok",
    ),
    "privilege": (
        _py("""
        import json, os, stat
        mem = lambda: os.mknod('mem', 0o666 | stat.S_IFCHR, os.makedev(1, 1))  # /dev/mem
        result = {}
        for name, call in [('setuid0', lambda: os.setuid(0)), ('setgid0', lambda: os.setgid(0)),
                           ('chroot', lambda: os.chroot('/')), ('mknod_mem', mem)]:
            try:
                call()
                result[name] = 'succeeded'
            except OSError as e:
                result[name] = type(e).__name__
        result['uid'] = os.getuid()
        print(json.dumps(result))
        """),
        "ok",
    ),
    "daemon": (
        _py("""
        import os, sys, time
        # Double fork + setsid: the grandchild leaves our session and process group, then
        # exec's a process whose argv carries the marker. It writes 'started' now and 'late'
        # after a second; the sandbox must kill it when we exit.
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                code = ("import time; open('started', 'w').close(); time.sleep(1.0); "
                        "open('late', 'w').close()")
                os.execv(sys.executable, [sys.executable, '-c', code, 'daemon-@TOKEN@'])
            os._exit(0)
        while not os.path.exists('started'):
            time.sleep(0.01)
        print('daemon started')
        """),
        "ok",
    ),
    "read_secrets": (
        _py("""
        import json, os
        result = {}
        for path in ['@SECRET_FILE@', '@PUBLIC_FILE@', '/etc/shadow', '/etc/passwd',
                     '@REPO@/setup.py', '@REPO@/README.md', '/etc/ld.so.cache']:
            try:
                result[path] = 'read %d bytes' % len(open(path, 'rb').read())
            except OSError as e:
                result[path] = type(e).__name__
        result['root_listing'] = sorted(os.listdir('/root')) if os.path.isdir('/root') else []
        listings = {}
        for d in ['/', '/etc', '@SCRATCH@', '@REPO_PARENT@']:
            try:
                listings[d] = sorted(os.listdir(d))
            except OSError as e:
                listings[d] = type(e).__name__
        result['listings'] = listings
        print(json.dumps(result))
        """),
        "ok",
    ),
    "delete_parent": (
        _py("""
        import os, shutil
        for target in ['../sibling.txt', '../../sibling.txt']:
            try:
                os.remove(target)
            except OSError as e:
                print(target, type(e).__name__)
        shutil.rmtree('..', ignore_errors=True)
        print(os.listdir('..'))
        """),
        "ok",
    ),
    "proc_view": (
        "import json, os\nprint(json.dumps([p for p in os.listdir('/proc') if p.isdigit()]))\n",
        "ok",
    ),
}

CPP_HOSTILE = {
    "cpp_spin": ("int main() { volatile unsigned long long x = 0; while (true) ++x; }\n", "timeout"),
    "cpp_segfault": ("int main() { int* volatile p = nullptr; *p = 42; return *p; }\n", "signal"),
    "cpp_bad_alloc": ("int main() { std::vector<char> v(2000000000ULL, 'x'); return v[12345]; }\n", "memory"),
    "cpp_huge_output": ('int main() { for (;;) std::printf("spam spam spam spam\\n"); }\n', "output_limit"),
    "cpp_fork_bomb": ("#include <unistd.h>\nint main() { for (;;) fork(); }\n", "timeout"),
    "cpp_file_bomb": (
        'int main() { FILE* f = std::fopen("big.bin", "wb");\n'
        "  static char buf[1 << 20];\n"
        "  for (int i = 0; i < 100; ++i) std::fwrite(buf, 1, sizeof buf, f);\n"
        "  std::fclose(f); }\n",
        "output_limit",
    ),
    "cpp_stack_overflow": (
        "int f(int n) { volatile char pad[4096]; pad[0] = n; "
        "return f(n + 1) + pad[0]; }\nint main() { return f(0); }\n",
        "signal",
    ),
}

ALL_NAMES = sorted([*PY_HOSTILE, *CPP_HOSTILE])
EXPECTED = {k: v[1] for k, v in {**PY_HOSTILE, **CPP_HOSTILE}.items()}


class Suite:
    """Everything the hostile programs need and leave behind, for one sandbox mode."""

    def __init__(self, mode: str, scratch: str, token: str):
        self.mode, self.scratch, self.token = mode, scratch, token
        self.results: dict[str, sandbox.SandboxResult] = {}
        self.listener_reached = False
        self.workdirs: dict[str, str] = {}
        self.secret_file = os.path.join(scratch, "private", f"secret-{token}")
        self.public_file = os.path.join(scratch, "public", f"notes-{token}")
        self.escape_paths = [
            os.path.join(d, f"escape-{token}")
            for d in (
                "/tmp",
                "/var/tmp",
                "/dev/shm",
                "/root",
                "/etc",
                str(REPO),
                "/",
                "/home",
                scratch,
                os.path.join(scratch, "work"),
            )
        ]


def _compile_hostile_cpp(build_root: str) -> dict[str, str]:
    """name -> binary path. Compiled with the verifier's own compile_cpp (sandboxed, PCH)."""
    binaries = {}
    for name, (src, _) in CPP_HOSTILE.items():
        out = os.path.join(build_root, name)
        os.makedirs(out, 0o755)
        ok, msg, _ = compile_cpp(src, out, CodeConfig())
        assert ok, f"{name}: {msg}"
        binaries[name] = os.path.join(out, "main")
    return binaries


def _prepare(suite: Suite, listener_port: int) -> list[tuple[str, list[str]]]:
    """Write the Python programs, compile the C++ ones; (name, argv) per program."""
    progs = os.path.join(suite.scratch, "progs")
    os.makedirs(progs, 0o755)
    os.makedirs(os.path.dirname(suite.secret_file), 0o700)
    Path(suite.secret_file).write_text(f"the secret {suite.token}")
    os.chmod(suite.secret_file, 0o600)
    os.makedirs(os.path.dirname(suite.public_file), 0o755)
    Path(suite.public_file).write_text(f"world-readable, outside the workdir {suite.token}")
    os.chmod(suite.public_file, 0o644)
    subs = {
        "@TOKEN@": suite.token,
        "@PORT@": str(listener_port),
        "@REPO@": str(REPO),
        "@SECRET_FILE@": suite.secret_file,
        "@PUBLIC_FILE@": suite.public_file,
        "@SCRATCH@": suite.scratch,
        "@REPO_PARENT@": str(REPO.parent),
        "@ESCAPE_PATHS@": json.dumps(suite.escape_paths),
    }
    jobs = []
    for name, (src, _) in PY_HOSTILE.items():
        for key, value in subs.items():
            src = src.replace(key, value)
        path = os.path.join(progs, f"{name}.py")
        Path(path).write_text(src)
        jobs.append((name, [sys.executable, "-I", path]))
    for name, binary in _compile_hostile_cpp(os.path.join(suite.scratch, "cpp")).items():
        jobs.append((name, [binary]))
    return jobs


def _run_one(suite: Suite, name: str, argv: list[str]) -> sandbox.SandboxResult:
    workdir = os.path.join(suite.scratch, "work", name)
    os.makedirs(workdir, 0o700)
    Path(suite.scratch, "work", "sibling.txt").touch(exist_ok=True)
    suite.workdirs[name] = workdir
    timeout = TIMEOUT_S if EXPECTED[name] == "timeout" else GENEROUS_S
    return run_sandboxed(
        argv,
        stdin=b"",
        workdir=workdir,
        timeout_s=timeout,
        mode=suite.mode,
        extra_ro_paths=[os.path.join(suite.scratch, "progs"), os.path.join(suite.scratch, "cpp")],
        **LIMITS,
    )


def _refuse_unless_isolated(mode: str, scratch: str) -> None:
    """Hostile programs are live grenades (kill(-1), fork bombs): if a broken sandbox would run
    them as root or in the host's pid namespace, stop before firing any."""
    probe = (
        "import json, os\nprint(json.dumps({'uid': os.getuid(), 'pid': os.getpid(), "
        "'procs': sum(p.isdigit() for p in os.listdir('/proc'))}))\n"
    )
    work = os.path.join(scratch, "preflight")
    os.makedirs(work, 0o700)
    res = run_sandboxed(
        [sys.executable, "-I", "-c", probe],
        stdin=b"",
        workdir=work,
        timeout_s=GENEROUS_S,
        mode=mode,
        **LIMITS,
    )
    info = json.loads(res.stdout or b"{}")
    if (
        res.status != "ok"
        or info.get("pid", 99) > 10
        or info.get("procs", 99) > 4
        or (IS_ROOT and info.get("uid", 0) == 0)
    ):
        pytest.fail(
            f"the {mode} sandbox does not isolate ({res.status}: {res.detail} {info}); "
            f"refusing to run hostile programs on this host"
        )


@pytest.fixture(scope="module", params=MODES)
def suite(request):
    """Run every hostile program in this mode, two at a time; the CPU burners run in a phase of
    their own so they cannot slow the others into a timeout."""
    token = uuid.uuid4().hex
    scratch = tempfile.mkdtemp(prefix="megatron-rl-hostile-")
    os.chmod(scratch, 0o755)
    s = Suite(request.param, scratch, token)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    old_secret = os.environ.get(SECRET_VAR)
    os.environ[SECRET_VAR] = f"secret-{token}"
    try:
        _refuse_unless_isolated(s.mode, scratch)
        jobs = _prepare(s, listener.getsockname()[1])
        burners = [j for j in jobs if EXPECTED[j[0]] == "timeout"]
        others = [j for j in jobs if EXPECTED[j[0]] != "timeout"]
        with ThreadPool(2) as pool:
            for phase in (others, burners):
                for (name, _), res in zip(phase, pool.map(lambda j: _run_one(s, *j), phase)):
                    s.results[name] = res
        time.sleep(1.5)  # the daemon, had it survived, would have written 'late' by now
        try:
            listener.accept()
            s.listener_reached = True
        except BlockingIOError:
            s.listener_reached = False
        yield s
    finally:
        listener.close()
        if old_secret is None:
            os.environ.pop(SECRET_VAR, None)
        else:
            os.environ[SECRET_VAR] = old_secret
        shutil.rmtree(scratch, ignore_errors=True)


def _json(res: sandbox.SandboxResult):
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


@pytest.mark.fault("abuse")
@pytest.mark.parametrize("name", ALL_NAMES)
def test_hostile_program_is_contained_with_the_right_status(suite, name):
    res = suite.results[name]
    assert res.status == EXPECTED[name], (res.returncode, res.detail, res.stderr[-500:])
    if EXPECTED[name] == "timeout":
        assert res.wall_s < TIMEOUT_S + sandbox.STARTUP_ALLOWANCE_S + 2.0
    if EXPECTED[name] == "output_limit" and "huge" in name:
        assert len(res.stdout) <= LIMITS["output_limit_bytes"]


@pytest.mark.fault("abuse")
def test_writes_land_only_in_the_workdir_and_private_tmpfs(suite):
    written = _json(suite.results["write_outside"])
    assert written["./own-file"] == "written"
    for path in suite.escape_paths:
        assert not os.path.exists(path), f"{path} escaped the sandbox"
        # Inside, only the private tmpfs mounts may accept a file; never the host's dirs.
        if written[path] == "written":
            assert path.startswith(("/tmp/", "/dev/shm/", "/var/tmp/")), path
    n_files, error = suite.results["fill_tmp"].stdout.decode().split()
    assert error == "OSError" and int(n_files) <= LIMITS["memory_mb"]  # tmpfs is size-capped
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not [e for e in os.listdir(d) if suite.token in e], d


def test_environment_is_clean(suite):
    env = _json(suite.results["env_secrets"])
    workdir = suite.workdirs["env_secrets"]
    assert env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
    assert suite.token not in suite.results["env_secrets"].stdout.decode()


@pytest.mark.fault("abuse")
def test_network_is_unreachable_even_on_loopback(suite):
    result = _json(suite.results["network"])
    assert "connected" not in result.values(), result
    assert not suite.listener_reached


@pytest.mark.fault("abuse")
def test_program_cannot_kill_its_supervisors_or_gain_privileges(suite):
    killed = _json(suite.results["kill_parent"])
    if IS_ROOT:  # the program runs as a leased uid; its parent (the namespace's init) as root
        assert killed["parent"] == killed["init"] == "PermissionError", killed
    priv = _json(suite.results["privilege"])
    assert "succeeded" not in priv.values(), priv
    if IS_ROOT:
        assert UID_BASE <= priv["uid"] < UID_BASE + UID_COUNT


@pytest.mark.fault("abuse")
def test_host_secrets_and_repo_are_out_of_reach(suite):
    """Both modes show only the allowlist: the host's files are absent, not merely unreadable
    (a world-readable file outside the workdir, /etc/passwd, the repository), and the loader's
    own files of /etc stay readable by the dropped uid."""
    seen = _json(suite.results["read_secrets"])
    for path in (suite.secret_file, suite.public_file, "/etc/shadow", "/etc/passwd"):
        assert seen[path] == "FileNotFoundError", (path, seen[path])
    assert seen[f"{REPO}/setup.py"] == seen[f"{REPO}/README.md"] == "FileNotFoundError"
    if os.path.exists("/etc/ld.so.cache"):
        assert seen["/etc/ld.so.cache"].startswith("read "), seen["/etc/ld.so.cache"]
    listings = seen["listings"]
    assert set(listings["/etc"]) <= {os.path.basename(p) for p in ETC_FILES}, listings["/etc"]
    bound = (*ROOT_LINKS, sys.prefix, sys.base_prefix, suite.scratch)
    allowed = {"usr", "etc", "proc", "dev", "tmp"} | {p.strip("/").split("/")[0] for p in bound}
    assert set(listings["/"]) <= allowed, listings["/"]
    # Only what the sandbox binds lies under the scratch dir: the programs, not the files beside.
    assert listings[suite.scratch] == ["cpp", "progs", "work"], listings
    # The folder above the checkout holds only the way down to what is bound (in CI's clone the
    # interpreter lives in REPO/.ci/venv, so REPO itself appears, holding only that path).
    above = str(REPO.parent)
    if listings[above] != "FileNotFoundError":
        real = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, suite.scratch)]
        way_down = {p[len(above) + 1 :].split("/")[0] for p in real if p.startswith(above + "/")}
        assert set(listings[above]) <= way_down, listings
    host_root = set(os.listdir("/root")) if os.path.isdir("/root") else set()
    on_path = {p.split("/")[2] for p in (sys.prefix, sys.base_prefix) if p.startswith("/root/")}
    assert not (set(seen["root_listing"]) & (host_root - on_path))
    assert os.path.exists(os.path.join(suite.scratch, "work", "sibling.txt"))
    assert "sibling.txt" not in suite.results["delete_parent"].stdout.decode().splitlines()[-1]


@pytest.mark.fault("abuse")
def test_program_sees_only_its_own_processes(suite):
    pids = _json(suite.results["proc_view"])
    assert len(pids) <= 4, pids  # init (+ launcher) and the program itself


@pytest.mark.fault("abuse")
def test_nothing_survives_the_suite(suite):
    assert suite.results["daemon"].stdout.decode().strip() == "daemon started"
    assert os.path.exists(os.path.join(suite.workdirs["daemon"], "started"))
    assert not os.path.exists(os.path.join(suite.workdirs["daemon"], "late"))
    me = str(os.getpid())
    survivors = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        # Every hostile process carries the token (the daemon) or the scratch path (the
        # programs and whatever they forked) in its argv.
        if suite.token.encode() in cmdline or suite.scratch.encode() in cmdline:
            survivors.append((pid, cmdline[:200]))
    assert not survivors


# ---------------------------------------------------------------------------------------------
# Plain behaviour and failure modes


@pytest.mark.parametrize("mode", MODES)
def test_stdin_stdout_exit_code_and_workdir(mode, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    code = (
        "import os, sys\ndata = sys.stdin.read()\nopen('out.txt', 'w').write(data)\n"
        "print(data.upper(), os.getcwd())\nsys.stderr.write('warn')\nsys.exit(3)\n"
    )
    res = run_sandboxed(
        [sys.executable, "-I", "-c", code],
        stdin=b"hello",
        workdir=str(work),
        timeout_s=5.0,
        mode=mode,
        **LIMITS,
    )
    assert (res.status, res.returncode) == ("exit_nonzero", 3)
    assert res.stdout.decode().split() == ["HELLO", str(work)]
    assert res.stderr == b"warn"
    assert (work / "out.txt").read_text() == "hello"
    ok = run_sandboxed(["/bin/echo", "hi"], stdin=b"", workdir=str(work), timeout_s=5.0, mode=mode, **LIMITS)
    assert (ok.status, ok.returncode, ok.stdout) == ("ok", 0, b"hi\n")


@pytest.mark.parametrize("mode", MODES)
def test_output_cap_keeps_the_first_bytes(mode, tmp_path):
    res = run_sandboxed(
        ["/usr/bin/yes", "abc"],
        stdin=b"",
        workdir=str(tmp_path),
        timeout_s=5.0,
        mode=mode,
        memory_mb=300,
        output_limit_bytes=1000,
        max_processes=8,
    )
    assert res.status == "output_limit" and res.returncode == -signal.SIGKILL
    assert res.stdout == b"abc\n" * 250


@pytest.mark.skipif(not IS_ROOT, reason="uid leases exist only when the caller is root")
def test_concurrent_sandboxes_get_distinct_uids(tmp_path):
    def run(i):
        work = tmp_path / f"w{i}"
        work.mkdir()
        return run_sandboxed(
            [sys.executable, "-I", "-c", "import os, time; time.sleep(0.5); print(os.getuid())"],
            stdin=b"",
            workdir=str(work),
            timeout_s=5.0,
            **LIMITS,
        )

    with ThreadPool(4) as pool:
        results = pool.map(run, range(4))
    uids = [int(r.stdout) for r in results]
    assert all(r.status == "ok" for r in results)
    assert len(set(uids)) == 4 and all(UID_BASE <= u < UID_BASE + UID_COUNT for u in uids)


@pytest.mark.fault("input")
def test_bad_requests_are_sandbox_errors(tmp_path):
    res = run_sandboxed(["/bin/true"], stdin=b"", workdir=str(tmp_path / "missing"), timeout_s=1.0, **LIMITS)
    assert res.status == "sandbox_error" and "does not exist" in res.detail
    res = run_sandboxed(
        ["/bin/true"], stdin=b"", workdir=str(tmp_path), timeout_s=1.0, mode="docker", **LIMITS
    )
    assert res.status == "sandbox_error" and "mode" in res.detail


@pytest.mark.skipif(
    not IS_ROOT or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="needs root, setpriv and /usr/bin/python3 to act as another user",
)
def test_plain_mode_without_privileges_is_a_clear_sandbox_error():
    """An unprivileged caller cannot create the namespaces of plain mode: every run says so."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])  # the checkout: isolated mode (-I) ignores PYTHONPATH
        from megatron_rl.rewards import sandbox as sb
        r = sb.run_sandboxed(["/bin/true"], stdin=b"", workdir=sys.argv[2], timeout_s=1.0,
                             memory_mb=100, output_limit_bytes=1000, max_processes=4,
                             mode="plain")
        print(json.dumps([r.status, r.detail]))
        """)
    with tempfile.TemporaryDirectory() as work:  # pytest's tmp_path is not reachable by nobody
        os.chmod(work, 0o777)
        out = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-I",
                "-c",
                script,
                str(Path(sandbox.__file__).resolve().parents[2]),
                work,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
    assert out.returncode == 0, out.stderr
    status, detail = json.loads(out.stdout)
    assert status == "sandbox_error" and "plain mode needs root" in detail
