"""Every command-line number has a range, checked before the command does anything.

A bare ``type=int`` takes ``--sequences -5`` and lets it reach the code, where it ends as a
stack or "internal error" (issue 49's ``bench collation --sequences -5``). Every integer and
number option takes :func:`megatron_rl.errors.int_arg` / :func:`~megatron_rl.errors.float_arg`
instead. Two checks hold that:

- the source: no ``add_argument(..., type=int)`` or ``type=float`` in the package or tools/;
- the parsers themselves: every verb's parser (each passthrough verb and each benchmark is run up
  to its ``parse_args``, where the parser is captured) is walked, and every integer option
  refuses a hugely negative value and a word, every number option NaN and infinity -- with
  argparse's usage error (exit 2) naming the flag.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.cli import _PASSTHROUGH, TOOLS_DIR, _benchmarks, build_parser

ROOT = Path(__file__).resolve().parents[1]


def _bare_number_types(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for kw in node.keywords:
                if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: type={kw.value.id}")
    return found


def test_no_option_takes_a_bare_int_or_float():
    files = sorted((ROOT / "megatron_rl").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    assert len(files) > 50
    bare = [hit for f in files for hit in _bare_number_types(f)]
    assert not bare, "options without a range (use errors.int_arg / float_arg):\n" + "\n".join(bare)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def _capture_parsers() -> Iterator[None]:
    """``parse_args`` / ``parse_known_args`` raise with the parser instead of parsing."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


def _parser_of(run) -> argparse.ArgumentParser:
    with _capture_parsers(), pytest.raises(_Captured) as got:
        run()
    return got.value.parser


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {"megatron-rl": build_parser()}
    for verb, (module, _) in _PASSTHROUGH.items():
        main = __import__(module, fromlist=["main"]).main
        parsers[f"megatron-rl {verb}"] = _parser_of(lambda main=main: main([]))
    if str(TOOLS_DIR) not in sys.path:  # as `megatron-rl bench` runs them
        sys.path.insert(0, str(TOOLS_DIR))
    for name, path in _benchmarks().items():
        argv = sys.argv
        sys.argv = [str(path)]
        try:
            main = runpy.run_path(str(path), run_name="bench")["main"]  # its __main__ block not run
            parsers[f"megatron-rl bench {name}"] = _parser_of(main)
        finally:
            sys.argv = argv
    return parsers


def _options(parser: argparse.ArgumentParser, prog: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prog} {name}")
        elif action.type is not None:
            yield f"{prog} {'/'.join(action.option_strings) or action.dest}", action


@pytest.fixture(scope="module")
def options() -> list[tuple[str, argparse.Action]]:
    found = [opt for prog, parser in _all_parsers().items() for opt in _options(parser, prog)]
    assert len(found) > 150  # every verb and benchmark was reached
    return found


def _refused(parser_type, text: str) -> bool:
    try:
        parser_type(text)
    except (argparse.ArgumentTypeError, ValueError):
        return True
    return False


def test_every_integer_option_has_a_range(options):
    ints = [(name, a) for name, a in options if getattr(a.type, "__name__", "") == "integer"]
    assert len(ints) > 100
    unbounded = [name for name, a in ints if not _refused(a.type, "-" + "9" * 30)]
    words = [name for name, a in ints if not _refused(a.type, "ten")]
    assert not unbounded, f"integer options that take -10**30: {unbounded}"
    assert not words, f"integer options that take a word: {words}"


def test_every_number_option_refuses_nan_and_infinity(options):
    floats = [(name, a) for name, a in options if getattr(a.type, "__name__", "") == "number"]
    assert len(floats) > 20
    taken = [f"{name} {v}" for name, a in floats for v in ("nan", "inf", "-inf") if not _refused(a.type, v)]
    assert not taken, f"number options that take a non-finite value: {taken}"


def test_no_option_uses_a_builtin_number_type(options):
    assert not [name for name, a in options if a.type in (int, float)]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["eval", "--limit", "-1"], "--limit"),
        (["bench", "collation", "--sequences", "-5"], "--sequences"),
        (["bench", "collation", "--budget", "0"], "--budget"),
        (["bench", "scale", "--servers", "4,,8"], "--servers"),
        (["bench", "long-context", "--cp", "abc"], "--cp"),
        (["bench", "generation", "--hf-batches", "0,2"], "--hf-batches"),
        (["serve-engine", "--model", "m", "--max-slots", "0"], "--max-slots"),
        (["curate", "translate-mark", "--languages", "fr,,de"], "--languages"),
        (["ablate", "async", "--seeds", "nan"], "--seeds"),
    ],
)
def test_a_bad_value_is_one_usage_line_naming_the_flag(argv, flag, capsys):
    from megatron_rl.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 or (len(err) == 2 and err[0].startswith("usage:")), err
    assert flag in err[-1] and "internal error" not in err[-1] and "Traceback" not in err[-1]
