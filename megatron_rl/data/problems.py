"""Problem sets on disk: the :class:`Problem` record, readers with ``file:line: field`` errors, and
atomic writers.

A problem file holds one record per line (JSONL; also a JSON array, CSV, Parquet when ``pyarrow``
is installed, or ``hf:NAME[:SPLIT]`` through ``datasets`` when installed)::

    {"id": "p1", "problem": "What is 2+2?", "answer": "4"}                           # math
    {"id": "c1", "problem": "Read n, print n+1.", "tests": [{"input": "1\\n", "output": "2\\n"}],
     "language": "python", "solutions": [{"language": "python", "code": "print(int(input())+1)"}]}

Known fields: ``id`` (default: a hash of the statement), ``problem``, ``task`` (``math``/``code``,
else inferred: ``tests`` means code, ``answer`` math), ``answer``, ``tests``, ``language`` (the
programming language a code problem asks for), ``solutions``, ``choices`` (multiple choice),
``lang`` (the natural language of the statement, e.g. ``fr``). Every other field is kept in
``meta`` and written back unchanged, so curation never loses a user's columns.

:func:`write_problems` writes through :mod:`megatron_rl.fileio`: an output either does not exist or
is complete.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megatron_rl.fileio import JsonlError, iter_jsonl, write_jsonl
from megatron_rl.rewards.compose import RewardInput

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = [
    "DataError",
    "Problem",
    "check_scorable",
    "problem_from_json",
    "read_problems",
    "read_records",
    "reward_input",
    "write_problems",
]

_KNOWN = ("id", "problem", "task", "answer", "tests", "language", "solutions", "choices", "lang")


class DataError(ValueError):
    """A malformed input record; the message starts with ``file:line: field:``."""


@dataclass(kw_only=True)
class Problem:
    """One problem of a data set (math: statement + reference answer; code: statement + tests)."""

    id: str
    problem: str
    task: Literal["math", "code"] = "math"
    answer: str | None = None  # math reference (LaTeX or plain)
    # Any: JSON records whose fields vary by source; read_problems checks the ones it uses.
    tests: list[dict[str, Any]] | None = None  # code: [{"input": str, "output": str}, ...]
    language: str | None = None  # code: "python" / "cpp" when the statement asks for one
    solutions: list[dict[str, str]] | None = None  # code: [{"language": ..., "code": ...}]
    choices: list[str] | dict[str, str] | None = None  # multiple-choice options, when separate
    lang: str | None = None  # natural language of the statement (ISO code), when known
    meta: dict[str, Any] = field(default_factory=dict)  # every other field, written back as is

    def to_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"id": self.id, "problem": self.problem, "task": self.task}
        for name in _KNOWN[3:]:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return {**out, **self.meta}


def _fail(where: str, field_name: str, message: str) -> DataError:
    return DataError(f"{where}: {field_name}: {message}")


def _task(value: JsonValue, where: str) -> Literal["math", "code"]:
    if value == "math":
        return "math"
    if value == "code":
        return "code"
    raise _fail(where, "task", f"must be 'math' or 'code', got {value!r}")


def _check_tests(tests: JsonValue, where: str) -> None:
    if not isinstance(tests, list):
        raise _fail(where, "tests", f"expected a list of objects, got {type(tests).__name__}")
    for k, t in enumerate(tests):
        if not isinstance(t, dict):
            raise _fail(where, f"tests[{k}]", "expected an object")
        if t.get("type") == "function":
            if not isinstance(t.get("test"), str) or not isinstance(t.get("entry_point"), str):
                raise _fail(where, f"tests[{k}]", "a function test needs string 'test' and 'entry_point'")
            continue
        if not isinstance(t.get("input"), str):
            raise _fail(where, f"tests[{k}].input", "expected a string")
        if "output" in t and t["output"] is not None and not isinstance(t["output"], str):
            raise _fail(where, f"tests[{k}].output", "expected a string (or absent: to be generated)")


def _check_solutions(solutions: JsonValue, where: str) -> None:
    if not isinstance(solutions, list):
        raise _fail(where, "solutions", f"expected a list, got {type(solutions).__name__}")
    for k, s in enumerate(solutions):
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("code"), str)
            or not isinstance(s.get("language"), str)
        ):
            raise _fail(where, f"solutions[{k}]", 'expected {"language": str, "code": str}')


def problem_from_json(obj: JsonValue, where: str) -> Problem:
    """Validate one decoded record; ``where`` (``file:line``) prefixes every error."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    text = obj.get("problem")
    if not isinstance(text, str) or not text.strip():
        raise _fail(where, "problem", "missing or not a non-empty string")
    task = _task(obj.get("task") or ("code" if obj.get("tests") is not None else "math"), where)
    answer = obj.get("answer")
    if isinstance(answer, bool) or (answer is not None and not isinstance(answer, (str, int, float))):
        raise _fail(where, "answer", f"expected a string or a number, got {answer!r}")
    if task == "code":
        _check_tests(obj.get("tests", []), where)
    if obj.get("solutions") is not None:
        _check_solutions(obj["solutions"], where)
    for name in ("language", "lang"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise _fail(where, name, f"expected a string, got {obj[name]!r}")
    choices = obj.get("choices")
    if choices is not None and not (
        isinstance(choices, (list, dict))
        and all(isinstance(c, str) for c in (choices.values() if isinstance(choices, dict) else choices))
    ):
        raise _fail(where, "choices", "expected a list of strings or an object of strings")
    pid = obj.get("id")
    if pid is None:
        pid = hashlib.sha1(text.encode()).hexdigest()[:12]
    elif not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise _fail(where, "id", f"expected a string or an integer, got {pid!r}")
    return Problem(
        id=str(pid),
        problem=text,
        task=task,
        answer=None if answer is None else str(answer),
        tests=obj.get("tests"),
        language=obj.get("language"),
        solutions=obj.get("solutions"),
        choices=choices,
        lang=obj.get("lang"),
        meta={k: v for k, v in obj.items() if k not in _KNOWN},
    )


def _jsonl(path: Path) -> Iterator[tuple[str, JsonValue]]:
    with path.open("rb") as f:
        first = f.read(1)
    if first == b"[":  # a JSON array of records
        try:
            data = json.loads(path.read_bytes())
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        for i, obj in enumerate(data):
            yield f"{path}:record {i}", obj
        return
    try:
        for lineno, obj in iter_jsonl(path, objects=False):
            yield f"{path}:{lineno}", obj
    except JsonlError as e:
        raise DataError(str(e)) from None


def _parquet(path: Path) -> Iterator[tuple[str, JsonValue]]:
    try:
        import pyarrow.parquet as pq  # lazy: optional dependency (Parquet inputs)
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    row = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for obj in batch.to_pylist():
            yield f"{path}:row {row}", obj
            row += 1


def _hf(spec: str) -> Iterator[tuple[str, JsonValue]]:
    try:
        import datasets  # lazy: optional dependency (hf: inputs)
    except ImportError:
        raise DataError(
            f"{spec}: reading a Hugging Face dataset needs `datasets` (pip install datasets)"
        ) from None
    name, _, split = spec[len("hf:") :].partition(":")
    for i, obj in enumerate(datasets.load_dataset(name, split=split or "train")):
        yield f"{spec}:row {i}", dict(obj)


def read_records(path: str | os.PathLike[str]) -> Iterator[tuple[str, JsonValue]]:
    """Yield ``(where, record)`` from a JSONL / JSON-array / CSV / Parquet file or ``hf:NAME``;
    ``where`` is ``file:line`` (``file:row N`` for tables). Records are JSON values (a table's
    rows: objects) that :func:`problem_from_json` checks."""
    spec = str(path)
    if spec.startswith("hf:"):
        yield from _hf(spec)
        return
    p = Path(spec)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    if p.suffix == ".parquet":
        yield from _parquet(p)
    elif p.suffix == ".csv":
        with p.open(encoding="utf-8", newline="") as f:
            for lineno, row in enumerate(csv.DictReader(f), 2):  # line 1 is the header
                yield f"{p}:{lineno}", row
    else:
        yield from _jsonl(p)


def read_problems(
    path: str | os.PathLike[str], *, limit: int | None = None, scorable: bool = False
) -> list[Problem]:
    """All problems of ``path`` (see the module docstring); raises :class:`DataError` on the first
    malformed record or a repeated id, and with ``scorable`` (training, evaluation) on the first
    that the reward cannot score (:func:`check_scorable`: a math problem without an answer, a code
    problem without tests), naming its file and line: its group could never be scored."""
    out: list[Problem] = []
    seen: dict[str, str] = {}
    for where, obj in read_records(path):
        p = problem_from_json(obj, where)
        if scorable:
            check_scorable(p, where)
        if p.id in seen:
            raise _fail(where, "id", f"{p.id!r} already used at {seen[p.id]}")
        seen[p.id] = where
        out.append(p)
        if limit is not None and len(out) >= limit:
            break
    return out


def check_scorable(p: Problem, where: str | None = None) -> None:
    """Raise :class:`DataError` (naming ``where`` or the problem id, and the field) unless the
    reward can score completions of ``p``: math needs a reference answer, code a non-empty list
    of tests, each with an expected output, in a language the code verifier runs."""
    at = where or f"problem {p.id!r}"
    if p.task == "math" and (p.answer is None or not str(p.answer).strip()):
        raise _fail(at, "answer", "a math problem needs a reference answer to be scored")
    if p.task == "code":
        if not p.tests:
            raise _fail(at, "tests", "a code problem needs a non-empty list of tests to be scored")
        for k, t in enumerate(p.tests):
            if t.get("type") != "function" and not isinstance(t.get("output"), str):
                raise _fail(
                    at,
                    f"tests[{k}].output",
                    "expected a string (run `megatron-rl curate code-tests` to generate missing outputs)",
                )
        if p.language not in (None, "python", "cpp"):
            raise _fail(at, "language", f"must be 'python' or 'cpp', got {p.language!r}")


def reward_input(
    p: Problem, completion: str, *, num_tokens: int | None = None, group_id: str | None = None
) -> RewardInput:
    """The one conversion of a problem and a completion into what the reward scores (the RL loop,
    sampling and evaluation, and ``megatron-rl reward`` all use it). ``group_id`` (default: the
    problem id) makes the completions of one group draw the same code tests."""
    return RewardInput(
        problem=p.problem,
        completion=completion,
        task=p.task,
        answer=p.answer,
        tests=p.tests,
        language=p.language if p.task == "code" else None,
        group_id=p.id if group_id is None else group_id,
        num_tokens=num_tokens,
    )


def write_problems(path: str | os.PathLike[str], problems: Iterable[Mapping[str, object] | Problem]) -> int:
    """Write problems (or plain records) one per line, atomically; returns the number of lines."""
    return write_jsonl(path, (p.to_json() if isinstance(p, Problem) else p for p in problems))
