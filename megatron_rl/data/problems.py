"""Problem sets on disk: the :class:`Problem` record, readers with ``file:line: field`` errors, and
atomic writers.

A problem file holds one record per line (JSONL; also a JSON array, CSV, Parquet when ``pyarrow``
is installed, a folder written by ``datasets``' ``save_to_disk``, or ``hf:NAME[:SPLIT]``, both
through ``datasets`` when installed)::

    {"id": "p1", "problem": "What is 2+2?", "answer": "4"}                           # math
    {"id": "c1", "problem": "Read n, print n+1.", "tests": [{"input": "1\\n", "output": "2\\n"}],
     "language": "python", "solutions": [{"language": "python", "code": "print(int(input())+1)"}]}

Known fields: ``id`` (default: a hash of the statement), ``problem``, ``task`` (``math``/``code``,
else inferred: ``tests`` means code, ``answer`` math), ``answer``, ``tests``, ``language`` (the
programming language a code problem asks for), ``solutions``, ``choices`` (multiple choice),
``lang`` (the natural language of the statement, e.g. ``fr``). Every other field is kept in
``meta`` and written back unchanged, so curation never loses a user's columns.

A data set with its own column names is read through a column mapping (our field -> the user's
column, e.g. ``{"problem": "question", "answer": "final_answer"}``; a dotted name reads a nested
field, ``reward_model.ground_truth``): the mapping is applied to every record of every format
before it is checked, and an error names the user's column too
(``train.parquet:row 7: answer (column 'final_answer'): expected a string or a number``). A
folder written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``, one split
chosen) reads like a file, through ``datasets.load_from_disk``; its rows are named
``folder/split:row N``, the folder ``save_to_disk`` wrote the split to.

:func:`write_problems` writes through :mod:`megatron_rl.fileio`: an output either does not exist or
is complete.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megatron_rl.errors import InputError
from megatron_rl.fileio import JsonlError, iter_jsonl, write_jsonl
from megatron_rl.rewards.compose import RewardInput

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = [
    "MAPPABLE_FIELDS",
    "DataError",
    "OptionError",
    "Problem",
    "check_scorable",
    "hold_out",
    "is_datasets_folder",
    "problem_from_json",
    "read_problems",
    "read_records",
    "reward_input",
    "write_problems",
]

_KNOWN = ("id", "problem", "task", "answer", "tests", "language", "solutions", "choices", "lang")
# What a column mapping may name: the known fields, and ``difficulty`` (kept in ``meta``; the
# prompt sampler's difficulty bounds read it).
MAPPABLE_FIELDS = (*_KNOWN, "difficulty")
# Files ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write at the top of the folder.
_DATASETS_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


class DataError(InputError):
    """A malformed input record; the message starts with ``file:line: field:``. ``where``,
    ``field`` and ``detail`` are its parts when a record's field is at fault."""

    def __init__(
        self, message: str, *, where: str | None = None, field: str | None = None, detail: str = ""
    ) -> None:
        super().__init__(message)
        self.where, self.field, self.detail = where, field, detail


class OptionError(DataError):
    """A reading option (``split``, ``where.COLUMN``) that the data cannot satisfy; ``option``
    names it, so that a caller holding a recipe can name its own field (``data.split``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option, self.message = option, message


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
    return DataError(f"{where}: {field_name}: {message}", where=where, field=field_name, detail=message)


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


def _lookup(obj: Mapping[str, JsonValue], column: str) -> tuple[bool, JsonValue]:
    """``(found, value)`` of ``column`` in a record: a top-level key, else a dotted path into
    nested objects (``reward_model.ground_truth``)."""
    if column in obj:
        return True, obj[column]
    node: JsonValue = obj
    for part in column.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def apply_columns(obj: dict[str, JsonValue], columns: Mapping[str, str], where: str) -> dict[str, JsonValue]:
    """The record with each mapped column under our field's name (``columns``: field ->
    column). A top-level column is moved; a nested one is copied (its parent stays in ``meta``).
    A column absent from the record leaves the field absent; a record that has both a mapped
    column and a column already named like its field is refused (one would be lost)."""
    out = dict(obj)
    for ours, theirs in columns.items():
        if ours == theirs:
            continue
        found, value = _lookup(obj, theirs)
        if not found:
            continue
        if ours in obj:
            raise _fail(
                where,
                ours,
                f"column {theirs!r} is mapped to {ours}, but the record also has a column {ours!r} "
                "(drop or rename one of them)",
            )
        out.pop(theirs, None)  # a top-level column moves; a nested one stays in its parent
        out[ours] = value
    return out


def problem_from_json(obj: JsonValue, where: str, *, columns: Mapping[str, str] | None = None) -> Problem:
    """Validate one decoded record; ``where`` (``file:line``) prefixes every error. ``columns``
    (field -> the user's column) renames columns first; an error on a mapped field names the
    column as well: ``answer (column 'final_answer'): ...``."""
    if not columns or not isinstance(obj, dict):
        return _problem(obj, where)
    mapped = apply_columns(obj, columns, where)
    try:
        return _problem(mapped, where)
    except DataError as e:
        raise _name_column(e, columns) from None


def _name_column(e: DataError, columns: Mapping[str, str] | None) -> DataError:
    """``e`` with the user's column beside our field when the field is a mapped one."""
    root = re.split(r"[.\[]", e.field or "", maxsplit=1)[0]
    if not columns or e.where is None or e.field is None or columns.get(root, root) == root:
        return e
    return _fail(e.where, f"{e.field} (column {columns[root]!r})", e.detail)


def _problem(obj: JsonValue, where: str) -> Problem:
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
    import pyarrow as pa  # lazy: as above

    row = 0
    try:
        batches = pq.ParquetFile(path).iter_batches()
        for batch in batches:
            for obj in batch.to_pylist():
                yield f"{path}:row {row}", obj
                row += 1
    except (pa.ArrowException, OSError) as e:  # truncated or not Parquet at all: name the file
        where = f" after row {row - 1}" if row else ""
        raise DataError(f"{path}: not a readable Parquet file{where} ({e})") from None


def _hf(spec: str, split: str) -> Iterator[tuple[str, JsonValue]]:
    try:
        import datasets  # lazy: optional dependency (hf: inputs)
    except ImportError:
        raise DataError(
            f"{spec}: reading a Hugging Face dataset needs `datasets` (pip install datasets)"
        ) from None
    name, _, in_spec = spec[len("hf:") :].partition(":")
    for i, obj in enumerate(datasets.load_dataset(name, split=in_spec or split or "train")):
        yield f"{spec}:row {i}", dict(obj)


def is_datasets_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` or
    ``DatasetDict.save_to_disk`` (it holds ``dataset_dict.json``, ``state.json`` or
    ``dataset_info.json``)."""
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in _DATASETS_MARKERS)


def _datasets_folder(path: Path, split: str, default_split: str | None) -> Iterator[tuple[str, JsonValue]]:
    """The rows of one split of a ``save_to_disk`` folder, converted by Arrow exactly as a
    Parquet file's are (``datasets``' own formatting turns a list of objects into an object of
    lists). ``split`` "": the folder's only split, else ``default_split`` when it has one."""
    try:
        import datasets  # lazy: optional dependency (datasets folders)
    except ImportError:
        raise DataError(
            f"{path}: reading a datasets folder needs `datasets` (pip install datasets)"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:  # missing or corrupt files, bad JSON, Arrow errors
        raise DataError(f"{path}: not a readable datasets folder: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        if split:
            if split not in loaded:
                raise OptionError("split", f"{path} has no split {split!r} (its splits: {', '.join(names)})")
            name = split
        elif len(names) == 1:
            name = names[0]
        elif default_split is not None and default_split in loaded:
            name = default_split
        else:
            raise OptionError("split", f"{path} holds several splits ({', '.join(names)}): name one")
        table, prefix = loaded[name], f"{path / name}"
    else:
        if split:
            raise OptionError(
                "split", f"{split!r} given, but {path} is a single Dataset (saved without splits)"
            )
        table, prefix = loaded, str(path)
    row = 0
    for batch in table.with_format("arrow").iter(batch_size=1024):
        for obj in batch.to_pylist():
            yield f"{prefix}:row {row}", obj
            row += 1


def read_records(
    path: str | os.PathLike[str], *, split: str = "", default_split: str | None = "train"
) -> Iterator[tuple[str, JsonValue]]:
    """Yield ``(where, record)`` from a JSONL / JSON-array / CSV / Parquet file, a ``datasets``
    folder (``save_to_disk``) or ``hf:NAME[:SPLIT]``; ``where`` is ``file:line`` (``file:row N``
    for tables). Records are JSON values (a table's rows: objects) that :func:`problem_from_json`
    checks. ``split`` chooses a folder's split (and ``hf:NAME``'s when the name gives none); ""
    takes the only one, else ``default_split`` (None: refuse to guess). A file has no splits: a
    ``split`` given with one raises :class:`OptionError`."""
    spec = str(path)
    if spec.startswith("hf:"):
        yield from _hf(spec, split)
        return
    p = Path(spec)
    if is_datasets_folder(p):
        yield from _datasets_folder(p, split, default_split)
        return
    if p.is_dir():
        raise DataError(
            f"{p}: a folder, but not one written by datasets' save_to_disk (no "
            f"{' / '.join(_DATASETS_MARKERS)})"
        )
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    if split:
        raise OptionError("split", f"{split!r} given, but {p} is a file (splits are for datasets folders)")
    if p.suffix == ".parquet":
        yield from _parquet(p)
    elif p.suffix == ".csv":
        lineno = 1
        try:
            with p.open(encoding="utf-8", newline="") as f:
                for lineno, row in enumerate(csv.DictReader(f), 2):  # line 1 is the header
                    yield f"{p}:{lineno}", row
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: not UTF-8 text (byte {e.start} of a block after line {lineno})") from None
        except csv.Error as e:
            raise DataError(f"{p}:{lineno + 1}: not CSV ({e})") from None
    else:
        yield from _jsonl(p)


def _matches(value: JsonValue, wanted: JsonValue) -> bool:
    """Equality as a user means it in a recipe: values of different types compare as text (a
    CSV cell ``"3"`` matches ``3``); true/false also match ``"true"``/``"false"`` but never 1/0."""
    if isinstance(value, bool) or isinstance(wanted, bool):
        return value is wanted or (
            isinstance(value, str) != isinstance(wanted, str) and str(value).lower() == str(wanted).lower()
        )
    if value is None or wanted is None:
        return value is wanted
    return value == wanted or str(value) == str(wanted)


def read_problems(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    scorable: bool = False,
    needs_reference: bool = True,
    columns: Mapping[str, str] | None = None,
    where: Mapping[str, JsonValue] | None = None,
    split: str = "",
    default_split: str | None = "train",
) -> list[Problem]:
    """All problems of ``path`` (see the module docstring); raises :class:`DataError` on the first
    malformed record or a repeated id, and with ``scorable`` (training, evaluation) on the first
    that the reward cannot score (:func:`check_scorable`: a math problem without an answer, a code
    problem without tests), naming its file and line: its group could never be scored.

    ``columns``: field -> the user's column, applied to every record first. ``where``: keep only
    records whose column (the user's name, as in the file; dotted for nested fields) equals the
    value, or one of the values of a list; a column no record has, or a filter that keeps
    nothing, raises :class:`OptionError` (``where.COLUMN`` / ``where``). ``limit``: stop after
    this many problems (after the filter). ``split`` / ``default_split``: :func:`read_records`."""
    out: list[Problem] = []
    seen: dict[str, str] = {}
    wanted = {k: v if isinstance(v, list) else [v] for k, v in (where or {}).items()}
    present: set[str] = set()  # where-columns some record has
    renamed = {ours: theirs for ours, theirs in (columns or {}).items() if ours != theirs}
    mapped: set[str] = set()  # mapped columns some record has
    keys: set[str] = set()  # the columns of the first record (named when a mapping finds nothing)
    records = 0
    for at, obj in read_records(path, split=split, default_split=default_split):
        records += 1
        if renamed and isinstance(obj, dict):
            keys = keys or set(obj)
            mapped.update(c for c in renamed.values() if c not in mapped and _lookup(obj, c)[0])
        if wanted and isinstance(obj, dict):
            keep = True
            for column, values in wanted.items():
                found, value = _lookup(obj, column)
                present.update([column] if found else [])
                keep = keep and found and any(_matches(value, w) for w in values)
            if not keep:
                continue
        p = problem_from_json(obj, at, columns=columns)
        if scorable:
            try:
                check_scorable(p, at, needs_reference=needs_reference)
            except DataError as e:
                raise _name_column(e, columns) from None
        if p.id in seen:
            raise _fail(at, "id", f"{p.id!r} already used at {seen[p.id]}")
        seen[p.id] = at
        out.append(p)
        if limit is not None and len(out) >= limit:
            break
    for ours, theirs in renamed.items():  # a mapping that can never apply is a mistake, not a no-op
        if records and theirs not in mapped:
            raise OptionError(
                f"columns.{ours}",
                f"no record of {path} has a column {theirs!r} (the first one has: {', '.join(sorted(keys))})",
            )
    if wanted and records:
        for column in wanted:
            if column not in present:
                raise OptionError(f"where.{column}", f"no record of {path} has a column {column!r}")
        if not out:
            raise OptionError("where", f"no record of {path} matches {dict(where or {})}")
    return out


def hold_out(
    problems: list[Problem], fraction: float, *, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Split ``problems`` into ``(kept, held_out)``: ``round(fraction * n)`` problems (at least
    one) held out, each list in the input order. Which ones depends only on the ids and
    ``seed`` (the smallest ``sha256(seed:id)``), not on the order of the file, so the held-out
    set stays the same when the file is reordered, and mostly the same when problems are added.
    Raises ValueError when nothing would be left to train on."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction: must be in (0, 1), got {fraction!r}")
    n_held = max(1, round(fraction * len(problems)))
    if n_held >= len(problems):
        raise ValueError(f"holding out {fraction:g} of {len(problems)} problems leaves none to train on")
    rank = sorted(problems, key=lambda p: hashlib.sha256(f"{seed}:{p.id}".encode()).hexdigest())
    held = {p.id for p in rank[:n_held]}
    return [p for p in problems if p.id not in held], [p for p in problems if p.id in held]


def check_scorable(p: Problem, where: str | None = None, *, needs_reference: bool = True) -> None:
    """Raise :class:`DataError` (naming ``where`` or the problem id, and the field) unless the
    reward can score completions of ``p``: math needs a reference answer, code a non-empty list
    of tests, each with an expected output, in a language the code verifier runs. With
    ``needs_reference`` False (a custom reward replaces the built-in check: ``reward.custom``,
    ``custom_mode: replace``) any problem can be scored."""
    if not needs_reference:
        return
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
    p: Problem,
    completion: str,
    *,
    num_tokens: int | None = None,
    group_id: str | None = None,
    record: dict[str, JsonValue] | None = None,
) -> RewardInput:
    """The one conversion of a problem and a completion into what the reward scores (the RL loop,
    sampling and evaluation, and ``megatron-rl reward`` all use it). ``group_id`` (default: the
    problem id) makes the completions of one group draw the same code tests; ``record``:
    ``p.to_json()`` when the caller has it already (a group's samples share one)."""
    return RewardInput(
        problem=p.problem,
        completion=completion,
        task=p.task,
        answer=p.answer,
        tests=p.tests,
        language=p.language if p.task == "code" else None,
        group_id=p.id if group_id is None else group_id,
        num_tokens=num_tokens,
        record=p.to_json() if record is None else record,  # every extra column: what a custom reward gets
    )


def write_problems(path: str | os.PathLike[str], problems: Iterable[Mapping[str, object] | Problem]) -> int:
    """Write problems (or plain records) one per line, atomically; returns the number of lines."""
    return write_jsonl(path, (p.to_json() if isinstance(p, Problem) else p for p in problems))
