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

Writers go through a temporary file in the same folder and ``os.replace``: an output either does
not exist or is complete.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = ["DataError", "Problem", "read_records", "read_problems", "problem_from_json",
           "write_jsonl", "write_json", "write_text", "atomic_path"]

_KNOWN = ("id", "problem", "task", "answer", "tests", "language", "solutions", "choices", "lang")


class DataError(ValueError):
    """A malformed input record; the message starts with ``file:line: field:``."""


@dataclass(kw_only=True)
class Problem:
    """One problem of a data set (math: statement + reference answer; code: statement + tests)."""

    id: str
    problem: str
    task: str = "math"  # "math" or "code"
    answer: str | None = None  # math reference (LaTeX or plain)
    tests: list[dict[str, Any]] | None = None  # code: [{"input": str, "output": str}, ...]
    language: str | None = None  # code: "python" / "cpp" when the statement asks for one
    solutions: list[dict[str, str]] | None = None  # code: [{"language": ..., "code": ...}]
    choices: list[str] | dict[str, str] | None = None  # multiple-choice options, when separate
    lang: str | None = None  # natural language of the statement (ISO code), when known
    meta: dict[str, Any] = field(default_factory=dict)  # every other field, written back as is

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "problem": self.problem, "task": self.task}
        for name in _KNOWN[3:]:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return {**out, **self.meta}


def _fail(where: str, field_name: str, message: str) -> DataError:
    return DataError(f"{where}: {field_name}: {message}")


def _check_tests(tests: Any, where: str) -> None:
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


def _check_solutions(solutions: Any, where: str) -> None:
    if not isinstance(solutions, list):
        raise _fail(where, "solutions", f"expected a list, got {type(solutions).__name__}")
    for k, s in enumerate(solutions):
        if (not isinstance(s, dict) or not isinstance(s.get("code"), str)
                or not isinstance(s.get("language"), str)):
            raise _fail(where, f"solutions[{k}]", "expected {\"language\": str, \"code\": str}")


def problem_from_json(obj: Any, where: str) -> Problem:
    """Validate one decoded record; ``where`` (``file:line``) prefixes every error."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    text = obj.get("problem")
    if not isinstance(text, str) or not text.strip():
        raise _fail(where, "problem", "missing or not a non-empty string")
    task = obj.get("task") or ("code" if obj.get("tests") is not None else "math")
    if task not in ("math", "code"):
        raise _fail(where, "task", f"must be 'math' or 'code', got {task!r}")
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
    options = choices.values() if isinstance(choices, dict) else choices
    if choices is not None and not (isinstance(choices, (list, dict))
                                    and all(isinstance(c, str) for c in options)):
        raise _fail(where, "choices", "expected a list of strings or an object of strings")
    pid = obj.get("id")
    if pid is None:
        pid = hashlib.sha1(text.encode()).hexdigest()[:12]
    elif not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise _fail(where, "id", f"expected a string or an integer, got {pid!r}")
    return Problem(id=str(pid), problem=text, task=task,
                   answer=None if answer is None else str(answer),
                   tests=obj.get("tests"), language=obj.get("language"),
                   solutions=obj.get("solutions"), choices=choices, lang=obj.get("lang"),
                   meta={k: v for k, v in obj.items() if k not in _KNOWN})


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        first = f.read(1)
        f.seek(0)
        if first == "[":  # a JSON array of records
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            for i, obj in enumerate(data):
                yield f"{path}:record {i}", obj
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    row = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for obj in batch.to_pylist():
            yield f"{path}:row {row}", obj
            row += 1


def _hf(spec: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{spec}: reading a Hugging Face dataset needs `datasets` "
                        "(pip install datasets)") from None
    name, _, split = spec[len("hf:"):].partition(":")
    for i, obj in enumerate(datasets.load_dataset(name, split=split or "train")):
        yield f"{spec}:row {i}", dict(obj)


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` from a JSONL / JSON-array / CSV / Parquet file or ``hf:NAME``;
    ``where`` is ``file:line`` (``file:row N`` for tables)."""
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


def read_problems(path: str | os.PathLike, *, limit: int | None = None) -> list[Problem]:
    """All problems of ``path`` (see the module docstring); raises :class:`DataError` on the first
    malformed record or a repeated id."""
    out: list[Problem] = []
    seen: dict[str, str] = {}
    for where, obj in read_records(path):
        p = problem_from_json(obj, where)
        if p.id in seen:
            raise _fail(where, "id", f"{p.id!r} already used at {seen[p.id]}")
        seen[p.id] = where
        out.append(p)
        if limit is not None and len(out) >= limit:
            break
    return out


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path``, on error it is
    removed (for writers that want a file name, e.g. ``savefig``)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}{final.suffix}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_jsonl(path: str | os.PathLike, records: Iterable[dict | Problem]) -> int:
    """Write one JSON object per line, atomically; returns the number of lines."""
    n = 0
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json() if isinstance(r, Problem) else r, ensure_ascii=False) + "\n")
            n += 1
    return n


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
