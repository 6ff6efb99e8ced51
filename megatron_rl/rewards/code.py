"""Code verifier: run a completion's program on a problem's tests in the sandbox.

``verify_code(code, language, tests, cfg, seed=...)`` draws ``cfg.tests_per_problem`` tests with
``select_tests`` (the same draw for every completion of a group when they share ``seed``), builds
the program once, runs it on each drawn test in a fresh working directory under
:func:`megatron_rl.rewards.sandbox.run_sandboxed`, and returns a :class:`Verdict`.

Languages: ``python`` runs with ``cfg.python`` (default: this interpreter) in isolated mode
(``-I``); ``cpp`` is compiled once per call, inside the sandbox too (the source is untrusted:
``#include "/etc/shadow"`` must not work), with ``g++ -std=<cpp_std> <cpp_flags>`` and a
force-included ``bits/stdc++.h`` whose precompiled form is built once per compiler and flag set
(see :func:`ensure_pch`).

Test forms:
  - stdin/stdout ``{"input": str, "output": str}``: outputs are compared line by line as
    whitespace-separated tokens, after dropping trailing empty lines (so trailing spaces, CRLF
    and runs of blanks do not matter; line breaks and leading empty lines do);
  - HumanEval function call ``{"type": "function", "test": str, "entry_point": str}``: one Python
    process runs the program, then the test source, then ``check(<entry_point>)``; an
    ``AssertionError`` is a wrong answer, any other failure a runtime error.

What the sandbox does and does not protect against is in ``sandbox.py``'s docstring.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.rewards.result import Verdict
from megatron_rl.rewards.sandbox import SandboxResult, run_sandboxed

__all__ = [
    "SANDBOX_REASONS",
    "CodeConfig",
    "compile_cpp",
    "ensure_pch",
    "extract_code_block",
    "interpreter",
    "normalise_language",
    "outputs_match",
    "remove_tree",
    "select_tests",
    "verify_code",
]

COMPILE_MEMORY_MB = 2048  # cc1plus maps the ~120 MB PCH and needs a few hundred MB on top
COMPILE_OUTPUT_LIMIT = 64 << 20  # compiler messages, and the size of the binary (RLIMIT_FSIZE)
PCH_BUILD_TIMEOUT_S = 300.0  # one-off, trusted: building bits/stdc++.h takes ~5 s here
DETAIL_LINES = 20  # lines of compiler / stderr output kept in a Verdict's detail

_LANGUAGES = {
    "python": "python",
    "py": "python",
    "python3": "python",
    "cpp": "cpp",
    "c++": "cpp",
    "cc": "cpp",
    "cxx": "cpp",
}
# A fence opens at the start of a line: ```lang (anything after the first word is ignored);
# the block ends at the next fence that starts a line. Unclosed blocks do not count.
_FENCE = re.compile(r"^ {0,3}```[ \t]*([^\s`]*)[^\n]*\n(.*?)^ {0,3}```", re.MULTILINE | re.DOTALL)
_STD = re.compile(r"^(c|gnu)\+\+(98|03|0x|11|1y|14|1z|17|2a|20|2b|23|2c|26)$")


@dataclass(kw_only=True)
class CodeConfig:
    """How code completions are run and scored (Magistral: 20 tests, 4 s, 300 MB, all-pass)."""

    tests_per_problem: int = 20  # tests drawn per problem (one draw for a group's completions)
    test_timeout_s: float = 4.0  # per test: wall clock (plus the sandbox's start-up allowance), CPU
    memory_mb: int = 300  # per test address-space limit (RLIMIT_AS) of each process
    compile_timeout_s: float = 10.0  # C++ compile limit (wall clock)
    cpp_std: str = "c++20"  # g++ -std= value
    cpp_flags: list[str] = field(default_factory=lambda: ["-O2"])  # extra g++ flags (PCH key too)
    partial_credit: bool = False  # False: all tests must pass (binary); True: fraction passed
    sandbox: str = "auto"  # "auto" (bubblewrap when installed, else plain), "bwrap", "plain"
    output_limit_mb: int = 16  # max stdout (and stderr, and any written file) per test
    max_processes: int = 32  # RLIMIT_NPROC (processes + threads) for the sandbox's leased uid
    pch_cache_dir: str = ""  # where the PCH of bits/stdc++.h lives; "" = ~/.cache/megatron-rl/pch
    python: str = ""  # interpreter for Python solutions; "" = sys.executable

    def __post_init__(self):
        check_range("tests_per_problem", self.tests_per_problem, low=1)
        check_range("test_timeout_s", self.test_timeout_s, low=0, high=600, low_open=True)
        check_range("memory_mb", self.memory_mb, low=32, high=1 << 20)
        check_range("compile_timeout_s", self.compile_timeout_s, low=0, high=600, low_open=True)
        if not _STD.match(self.cpp_std):
            raise ConfigFieldError("cpp_std", f"must be like c++20 or gnu++17, got {self.cpp_std!r}")
        if not isinstance(self.cpp_flags, list) or not all(
            isinstance(f, str) and f.startswith("-") and f != "-o" for f in self.cpp_flags
        ):
            raise ConfigFieldError(
                "cpp_flags",
                f"must be a list of g++ options starting with '-' (not -o), got {self.cpp_flags!r}",
            )
        check_choice("partial_credit", self.partial_credit, (True, False))
        check_choice("sandbox", self.sandbox, ("auto", "bwrap", "plain"))
        check_range("output_limit_mb", self.output_limit_mb, low=1, high=4096)
        check_range("max_processes", self.max_processes, low=2, high=4096)
        if self.python and not os.path.isabs(self.python):
            raise ConfigFieldError("python", f"must be an absolute path or '', got {self.python!r}")


def normalise_language(tag: str) -> str:
    """ "python"/"py"/"python3" -> "python"; "cpp"/"c++"/"cc"/"cxx" -> "cpp"; others lower-cased."""
    tag = tag.strip().lower()
    return _LANGUAGES.get(tag, tag)


def extract_code_block(answer: str) -> tuple[str | None, str | None]:
    """The first fenced block of ``answer`` as (language, code).

    ``language`` is normalised (:func:`normalise_language`), or None when the fence has no tag;
    ``code`` is the block's text without the fences. (None, None) when there is no closed block.
    """
    m = _FENCE.search(answer)
    if m is None:
        return None, None
    return (normalise_language(m.group(1)) if m.group(1) else None), m.group(2)


def select_tests(tests: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` of ``tests`` drawn without replacement by ``seed`` (all, in order, when there are at
    most ``n``). Deterministic: the same (tests, n, seed) always gives the same list, in the
    tests' original order."""
    if len(tests) <= n:
        return list(tests)
    picked = sorted(random.Random(seed).sample(range(len(tests)), n))
    return [tests[i] for i in picked]


def _tokens(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def outputs_match(got: str, want: str) -> bool:
    """Equal after splitting into lines, each line into whitespace-separated tokens, and
    dropping trailing empty lines."""
    return _tokens(got) == _tokens(want)


# ---------------------------------------------------------------------------------------------
# C++: precompiled header and compilation

_PCH_LOCK = threading.Lock()
_PCH_FAILED: dict[str, str] = {}  # key -> why, so a broken toolchain is not retried per call


def _pch_key(cfg: CodeConfig) -> str:
    return _pch_key_for(os.path.realpath(shutil.which("g++") or "g++"), cfg.cpp_std, tuple(cfg.cpp_flags))


@functools.lru_cache(maxsize=16)
def _pch_key_for(gxx: str, std: str, flags: tuple[str, ...]) -> str:
    # Cached: two compiler invocations per verify_code call would cost ~10 ms each.
    version = subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout
    machine = subprocess.run([gxx, "-dumpmachine"], capture_output=True, text=True).stdout
    blob = "\0".join([gxx, version, machine, std, *flags])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_pch(cfg: CodeConfig) -> tuple[str | None, str]:
    """(include dir, "") holding ``bits/stdc++.h.gch`` for this compiler, ``cpp_std`` and
    ``cpp_flags``, building it on first use; (None, why) when it cannot be built.

    Layout: ``<cache>/<key>/bits/stdc++.h.gch`` next to a ``bits/stdc++.h`` shim that
    ``#include_next``'s the real header, so that with ``-I <cache>/<key>`` gcc takes the .gch and,
    should it be unusable (gcc says so under ``-Winvalid-pch``), still finds the real header.
    Built in a temporary directory that is renamed into place: concurrent builders (threads or
    processes) each finish their own copy, one rename wins and the others discard theirs.
    """
    if shutil.which("g++") is None:
        return None, "g++ is not installed"
    key = _pch_key(cfg)
    root = cfg.pch_cache_dir or os.path.expanduser("~/.cache/megatron-rl/pch")
    final = os.path.join(root, key)
    if os.path.isfile(os.path.join(final, "bits", "stdc++.h.gch")):
        return final, ""
    with _PCH_LOCK:  # threads of one process wait for one build instead of racing
        if os.path.isfile(os.path.join(final, "bits", "stdc++.h.gch")):
            return final, ""
        if key in _PCH_FAILED:
            return None, _PCH_FAILED[key]
        why = _build_pch(cfg, root, final, key)
        if why:
            _PCH_FAILED[key] = why
            return None, why
    return final, ""


def _build_pch(cfg: CodeConfig, root: str, final: str, key: str) -> str:
    """Build into a temp dir and rename it to ``final``; "" on success, else the reason."""
    os.makedirs(root, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root)
    try:
        os.chmod(tmp, 0o755)  # the sandbox's uid must read it
        os.mkdir(os.path.join(tmp, "bits"), 0o755)
        with open(os.path.join(tmp, "bits", "stdc++.h"), "w") as f:
            f.write(
                "// Fallback when the .gch beside it is unusable: the real header.\n"
                "#include_next <bits/stdc++.h>\n"
            )
        src = os.path.join(tmp, "pch-source.h")
        with open(src, "w") as f:
            f.write("#include <bits/stdc++.h>\n")
        gch = os.path.join(tmp, "bits", "stdc++.h.gch")
        cmd = ["g++", f"-std={cfg.cpp_std}", *cfg.cpp_flags, "-x", "c++-header", src, "-o", gch]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PCH_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"building the PCH took over {PCH_BUILD_TIMEOUT_S:.0f} s"
        if proc.returncode != 0:
            return "building the PCH failed: " + proc.stderr[-2000:]
        for name in ("bits/stdc++.h", "bits/stdc++.h.gch", "pch-source.h"):
            os.chmod(os.path.join(tmp, name), 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # another builder's rename won (final exists and is not empty)
            pass
        return ""
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _compile(source: str, out_dir: str, cfg: CodeConfig, use_pch: bool) -> SandboxResult:
    """Write ``out_dir/main.cpp`` and compile it to ``out_dir/main`` inside the sandbox."""
    with open(os.path.join(out_dir, "main.cpp"), "w") as f:
        f.write(source)
    # Always force-include the header, so a solution compiles (or not) the same with the PCH
    # as without it; the PCH only changes how fast.
    cmd = ["g++", f"-std={cfg.cpp_std}", *cfg.cpp_flags, "-include", "bits/stdc++.h"]
    ro_paths = []
    if use_pch:
        pch, _why = ensure_pch(cfg)
        if pch:
            cmd += ["-Winvalid-pch", "-I", pch]
            ro_paths.append(pch)
    cmd += ["main.cpp", "-o", "main"]
    res = run_sandboxed(
        cmd,
        stdin=b"",
        workdir=out_dir,
        timeout_s=cfg.compile_timeout_s,
        memory_mb=COMPILE_MEMORY_MB,
        output_limit_bytes=COMPILE_OUTPUT_LIMIT,
        max_processes=cfg.max_processes,
        mode=cfg.sandbox,
        extra_ro_paths=ro_paths,
    )
    if os.geteuid() == 0:  # hand the build back to root: no later sandbox uid may own it
        for dirpath, dirnames, filenames in os.walk(out_dir):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, 0, 0, follow_symlinks=False)
    return res


def compile_cpp(
    source: str, out_dir: str, cfg: CodeConfig, *, use_pch: bool = True
) -> tuple[bool, str, float]:
    """Compile ``source`` to ``out_dir/main`` (``out_dir`` must exist; ``main.cpp`` is written
    there too) within ``cfg.compile_timeout_s``. Returns (ok, compiler messages, seconds).
    ``use_pch=False`` parses ``bits/stdc++.h`` from scratch (for benchmarks)."""
    start = time.monotonic()
    res = _compile(source, out_dir, cfg, use_pch)
    return res.status == "ok", _compile_message(res, cfg), time.monotonic() - start


def _compile_message(res: SandboxResult, cfg: CodeConfig) -> str:
    text = res.stderr.decode(errors="replace") + res.stdout.decode(errors="replace")
    if res.status == "timeout":
        return f"compilation exceeded {cfg.compile_timeout_s:g} s\n" + text
    if res.status in ("memory", "output_limit", "signal", "sandbox_error"):
        return f"compilation failed ({res.status}: {res.detail})\n" + text
    return text


# ---------------------------------------------------------------------------------------------
# Running tests

# A sandbox status -> the reward's reason (also how curation reports a solution's run).
SANDBOX_REASONS = {
    "exit_nonzero": "runtime_error",
    "signal": "runtime_error",
    "timeout": "timeout",
    "memory": "memory",
    "output_limit": "output_limit",
    "sandbox_error": "sandbox_error",
}


def _first_lines(text: str, n: int = DETAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[:n])


def _last_lines(text: str, n: int = DETAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def interpreter(cfg: CodeConfig) -> tuple[str, list[str]]:
    """(interpreter path, read-only paths it needs beyond what the sandbox always shows)."""
    if not cfg.python:
        return sys.executable, []
    real = os.path.realpath(cfg.python)
    prefix = os.path.dirname(os.path.dirname(real))  # <prefix>/bin/python3.x
    return cfg.python, ([] if prefix in ("/", "/usr") else [prefix])


def _check_test(test: dict, language: str) -> str:
    """ "" when ``test`` is well-formed for ``language``, else what is wrong."""
    if test.get("type") == "function":
        if language != "python":
            return "function-call tests need a Python program"
        if not isinstance(test.get("test"), str) or not isinstance(test.get("entry_point"), str):
            return "function test needs 'test' and 'entry_point' strings"
        return ""
    if not isinstance(test.get("input"), str) or not isinstance(test.get("output"), str):
        return "stdin/stdout test needs 'input' and 'output' strings"
    return ""


def _run_test(
    i: int,
    test: dict,
    program: list[str],
    build_dir: str,
    root: str,
    code: str,
    ro_paths: list[str],
    cfg: CodeConfig,
) -> tuple[str, str]:
    """Run one test in a fresh workdir under ``root``; (reason, detail) with reason "ok" on a
    pass."""
    argv, stdin = list(program), b""
    if test.get("type") == "function":
        path = os.path.join(build_dir, f"function_test_{i}.py")
        with open(path, "w") as f:
            f.write(f"{code}\n\n{test['test']}\n\ncheck({test['entry_point']})\n")
        argv[-1] = path
    else:
        stdin = test["input"].encode()
    workdir = os.path.join(root, f"test_{i}")
    os.mkdir(workdir, 0o700)
    try:
        res = run_sandboxed(
            argv,
            stdin=stdin,
            workdir=workdir,
            timeout_s=cfg.test_timeout_s,
            memory_mb=cfg.memory_mb,
            output_limit_bytes=cfg.output_limit_mb << 20,
            max_processes=cfg.max_processes,
            mode=cfg.sandbox,
            extra_ro_paths=[build_dir, *ro_paths],
        )
    finally:
        remove_tree(workdir)
    err = res.stderr.decode(errors="replace")
    if res.status != "ok":
        reason = SANDBOX_REASONS[res.status]
        if (
            test.get("type") == "function"
            and res.status == "exit_nonzero"
            and _last_lines(err, 1).startswith("AssertionError")
        ):
            reason = "wrong_answer"
        return reason, f"{res.detail}\n{_last_lines(err)}".strip()
    if test.get("type") == "function":
        return "ok", ""
    got = res.stdout.decode(errors="replace")
    if outputs_match(got, test["output"]):
        return "ok", ""
    return "wrong_answer", (
        f"expected {_first_lines(test['output'], 5)[:300]!r}, got {_first_lines(got, 5)[:300]!r}"
    )


def remove_tree(path: str) -> None:
    """rmtree that also removes what the program made unreadable (matters when not root)."""

    def fix(func, p, _exc):
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
            shutil.rmtree(p, ignore_errors=True)
        else:
            func(p)

    shutil.rmtree(path, onerror=fix)


def _build(
    code: str, language: str, build_dir: str, cfg: CodeConfig
) -> tuple[list[str], list[str]] | Verdict:
    """(argv to run, read-only paths), or the failing Verdict."""
    if language == "python":
        python, ro = interpreter(cfg)
        path = os.path.join(build_dir, "main.py")
        with open(path, "w") as f:
            f.write(code)
        return [python, "-I", path], ro
    res = _compile(code, build_dir, cfg, use_pch=True)
    if res.status == "sandbox_error":
        return Verdict(False, 0.0, "sandbox_error", res.detail)
    if res.status != "ok":
        return Verdict(False, 0.0, "compile_error", _first_lines(_compile_message(res, cfg)))
    return [os.path.join(build_dir, "main")], []


def verify_code(
    code: str, language: str | None, tests: list[dict], cfg: CodeConfig, *, seed: int = 0
) -> Verdict:
    """Run ``code`` on ``select_tests(tests, cfg.tests_per_problem, seed)``.

    Returns Verdict(correct, fraction, reason, detail). Binary mode (``partial_credit`` False)
    stops at the first failing test and returns its reason (wrong_answer, runtime_error,
    timeout, memory, output_limit) with fraction 0.0; partial credit runs every test and
    returns the fraction passed, with the first failure's reason. ``no_answer`` for an empty
    program or a language other than python/cpp, ``compile_error`` when g++ fails,
    ``bad_input`` for malformed tests, ``sandbox_error`` when the sandbox itself fails.
    """
    language = normalise_language(language or "")
    if language not in ("python", "cpp"):
        return Verdict(False, 0.0, "no_answer", f"unsupported language {language or None}")
    if not code or not code.strip():
        return Verdict(False, 0.0, "no_answer", "empty program")
    chosen = select_tests(tests, cfg.tests_per_problem, seed)
    if not chosen:
        return Verdict(False, 0.0, "bad_input", "the problem has no tests")
    for i, test in enumerate(chosen):
        problem = _check_test(test, language)
        if problem:
            return Verdict(False, 0.0, "bad_input", f"test {i + 1}: {problem}")
    root = tempfile.mkdtemp(prefix="megatron-rl-code-")
    os.chmod(root, 0o711)  # the sandbox's uid may pass through (plain mode, outside /tmp)
    try:
        build_dir = os.path.join(root, "build")
        os.mkdir(build_dir, 0o755)
        built = _build(code, language, build_dir, cfg)
        if isinstance(built, Verdict):
            return built
        program, ro_paths = built
        return _run_all(chosen, program, build_dir, root, code, ro_paths, cfg)
    finally:
        remove_tree(root)


def _run_all(
    chosen: list[dict],
    program: list[str],
    build_dir: str,
    root: str,
    code: str,
    ro_paths: list[str],
    cfg: CodeConfig,
) -> Verdict:
    passed, first_failure = 0, None
    for i, test in enumerate(chosen):
        reason, detail = _run_test(i, test, program, build_dir, root, code, ro_paths, cfg)
        if reason == "ok":
            passed += 1
            continue
        failure = (reason, f"test {i + 1}/{len(chosen)}: {reason}: {detail}")
        if reason == "sandbox_error" or not cfg.partial_credit:
            return Verdict(False, 0.0, *failure)
        first_failure = first_failure or failure
    if first_failure is None:
        return Verdict(True, 1.0, "ok", f"{passed}/{len(chosen)} tests passed")
    reason, detail = first_failure
    return Verdict(
        False, passed / len(chosen), reason, f"{passed}/{len(chosen)} tests passed; first failure: {detail}"
    )
