"""The one error path for every command: input mistakes are one line and an exit code, never a stack.

Code anywhere in the package raises a :class:`UserError` subclass for a mistake in what the user
gave it (an argument, a recipe field, a file's content, an output path that would overwrite an
input), with a message that names the file, line, field or argument and what is allowed. The
command-line boundary (:func:`run_cli`, used by ``megatron-rl`` and by every ``python -m`` entry
point) turns it into one line on stderr and the exit code of its kind:

====  =========================================================================================
code  meaning
====  =========================================================================================
1     the run itself stopped (no progress, non-finite loss, a corrupt checkpoint to resume from)
2     a bad argument or recipe value (argparse's own code for usage errors)
3     a bad input file: missing, unreadable, not UTF-8, malformed, nested too deeply, truncated
4     an output refused before the first byte: it is, contains or lies inside an input, or exists
5     a resource the machine lacks: a port in use, a full disk, too little memory
70    an internal error (a bug): still one line, and ``--debug`` shows the stack
130   interrupted (Ctrl-C)
====  =========================================================================================

Exceptions that the standard library raises for the same mistakes (``FileNotFoundError``,
``UnicodeDecodeError``, ``RecursionError`` on a deeply nested document, ``ENOSPC``...) are mapped
here too, so that a path nobody thought to wrap still ends in one line. A stack reaches the user
only with ``--debug`` (or ``MEGATRON_RL_DEBUG=1``).

Layer 0: imports nothing of megatron_rl.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys
import traceback
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence

__all__ = [
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OUTPUT",
    "EXIT_RESOURCE",
    "EXIT_STOPPED",
    "EXIT_USAGE",
    "NO_ACCELERATED_KERNELS_NOTE",
    "ArgumentParser",
    "InputError",
    "OutputError",
    "ResourceError",
    "RunStopped",
    "UsageError",
    "UserError",
    "classify",
    "debug_enabled",
    "float_arg",
    "int_arg",
    "int_list_arg",
    "quiet_library_warnings",
    "run_cli",
    "value_errors_as_usage",
]

EXIT_STOPPED = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_OUTPUT = 4
EXIT_RESOURCE = 5
EXIT_INTERNAL = 70  # EX_SOFTWARE in sysexits.h
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it

DEBUG_ENV = "MEGATRON_RL_DEBUG"


class UserError(Exception):
    """A mistake in what the user gave a command; its message is the whole line the user sees."""

    exit_code = EXIT_USAGE


class UsageError(UserError, ValueError):
    """A bad argument or configuration value (names the argument or field and what is allowed)."""

    exit_code = EXIT_USAGE


class InputError(UserError, ValueError):
    """A bad input file (names the file and, where there is one, the line or field)."""

    exit_code = EXIT_INPUT


class OutputError(UserError):
    """An output refused before anything was written (names the output and the input it hits)."""

    exit_code = EXIT_OUTPUT


class ResourceError(UserError):
    """Something the machine lacks or holds elsewhere: a port in use, disk space, memory."""

    exit_code = EXIT_RESOURCE


class RunStopped(UserError):
    """A run that cannot go on (no progress, a non-finite loss): says why and where it stopped."""

    exit_code = EXIT_STOPPED


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: a :class:`UsageError` naming the argument and
    pointing at ``--help``, instead of the usage block and ``error:`` line argparse prints. Its
    subparsers are of this class too (argparse makes them of the parent's class)."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


def _bounds(kind: str, lo: float | None, hi: float | None, low_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if low_open else '['}{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"{kind} {'>' if low_open else '>='} {_num(lo)}"
    return f"{kind} <= {_num(hi)}" if hi is not None else kind


def int_arg(lo: int | None = None, hi: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[lo, hi]`` (either end None: open); anything
    else is argparse's usage error naming the flag: ``--sequences: must be an integer >= 1, got
    -5``. ``note`` follows the range (``" (0: no limit)"``). Every integer flag takes one: a
    test (tests/test_cli_arguments.py) refuses a bare ``type=int``."""
    what = _bounds("an integer", lo, hi, False) + note

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
        return v

    parse.__name__ = "integer"  # argparse names the type in "invalid integer value"
    return parse


def int_list_arg(lo: int | None = 1, hi: int | None = None) -> Callable[[str], list[int]]:
    """An argparse ``type`` for a comma list of integers, each in ``[lo, hi]`` (``16,32,64``);
    an empty list, an empty item or one out of range is the flag's usage error naming it."""
    item = int_arg(lo, hi)
    what = "a comma list of " + _bounds("integers", lo, hi, False)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if not text.strip() or any(not x.strip() for x in parts):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        try:
            return [item(x.strip()) for x in parts]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None

    parse.__name__ = "integer list"
    return parse


def float_arg(
    lo: float | None = None, hi: float | None = None, *, low_open: bool = False, note: str = ""
) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``;
    either end None: open). NaN and infinities are refused with the rest."""
    what = _bounds("a number", lo, hi, low_open) + note

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        below = lo is not None and (v <= lo if low_open else v < lo)
        if v != v or v in (float("inf"), float("-inf")) or below or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v

    parse.__name__ = "number"
    return parse


@contextlib.contextmanager
def value_errors_as_usage() -> Iterator[None]:
    """Inside: a plain ``ValueError`` (a library's own check of an option, a config dataclass's
    ``__post_init__``) is a :class:`UsageError` with the same message; a UserError passes as it
    is. For a command whose options feed such checks directly (``curate``, ``eval``)."""
    try:
        yield
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e)) from None


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "no")


def _one_line(text: str) -> str:
    # Multi-line messages (a YAML parser's caret diagrams) are folded, so the user sees one line.
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached a command's boundary."""
    if isinstance(exc, UserError):
        return exc.exit_code, _one_line(str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, RecursionError):
        return EXIT_INPUT, "input nested too deeply to read (a document or a reference cycle)"
    if isinstance(exc, MemoryError):
        return EXIT_RESOURCE, "out of memory"
    if isinstance(exc, UnicodeDecodeError):
        return EXIT_INPUT, f"input is not UTF-8 text (byte {exc.start}: {exc.reason})"
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        why = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return EXIT_RESOURCE, f"{where}disk full: {why}"
        if exc.errno == errno.EFBIG:  # past this process's file-size limit (ulimit -f)
            return EXIT_RESOURCE, f"{where}{why} (over the file-size limit, ulimit -f)"
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENOMEM):
            return EXIT_RESOURCE, f"{where}{why}"
        return EXIT_INPUT, f"{where}{why}"
    return EXIT_INTERNAL, (
        f"internal error: {type(exc).__name__}: {_one_line(str(exc))} "
        f"(rerun with --debug for the stack, and please report it)"
    )


# Other packages' warnings that a user of the command line cannot act on, hiding the lines that
# matter (a train printed ~17 before its first own line). TE / Apex missing is said once, in our
# words; the rest is dropped. The Python API (no run_cli) leaves Python's warning filters alone,
# and --debug shows every warning as it is.
_NO_ACCELERATED_KERNELS = re.compile(
    r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"
)
_UNACTIONABLE = re.compile(
    r"full scope is deprecated"  # megatron-core's own default (cuda_graph_scope), not ours to set
    r"|Please use DTensor instead"  # torch's ShardedTensor deprecation, raised inside megatron-core
    r"|torch\.distributed\._shard"
)
# A CUDA setting megatron-core recommends for TP's async gradient all-reduce: meaningful on a GPU,
# noise on CPU (where each rank of a TP run printed it at every step).
_CUDA_ONLY = re.compile(r"CUDA_DEVICE_MAX_CONNECTIONS")


def _have_cuda() -> bool:
    torch = sys.modules.get("torch")  # the warning comes from megatron-core, so torch is imported
    return bool(torch is not None and torch.cuda.is_available())


NO_ACCELERATED_KERNELS_NOTE = (
    "note: Transformer Engine and Apex are not installed: megatron-core runs its PyTorch layers, norms, "
    "optimizer and gradient clipping instead (as expected without a GPU; install both on a GPU "
    "cluster for speed, docs/gpu-cluster.md)"
)


def quiet_library_warnings() -> None:
    """For a command's process: show other packages' warnings except those the user cannot act
    on (:data:`_UNACTIONABLE`); the missing TE / Apex as one note on rank 0."""
    shown = warnings.showwarning
    said = False

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        nonlocal said
        text = str(message)
        if _NO_ACCELERATED_KERNELS.search(text):
            if not said and os.environ.get("RANK", "0") == "0":
                print(NO_ACCELERATED_KERNELS_NOTE, file=sys.stderr)
            said = True
            return
        if _UNACTIONABLE.search(text) or (_CUDA_ONLY.search(text) and not _have_cuda()):
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def run_cli(prog: str, main: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` behind the boundary: the exit code it returns (an int; anything else,
    such as a benchmark's result dict, is success), or for an exception one
    line ``prog: message`` on stderr and the exit code of its kind. ``--debug`` anywhere in
    ``argv`` is taken out and shows the stack (so does ``MEGATRON_RL_DEBUG=1``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args = [a for a in args if a != "--debug"]
        os.environ[DEBUG_ENV] = "1"  # child processes (ranks, servers) show their stacks too
    if not debug_enabled():
        quiet_library_warnings()
    try:
        result = main(args)
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as e:  # argparse, or sys.exit("message") deep inside: keep its contract
        if isinstance(e.code, str):
            print(_one_line(e.code), file=sys.stderr)
            return EXIT_STOPPED
        return int(e.code or 0)
    except BaseException as e:  # noqa: BLE001 -- this is the boundary: nothing passes it as a stack
        code, message = classify(e)
        if debug_enabled():
            traceback.print_exc()
        print(f"{prog}: {message}", file=sys.stderr)
        return code
