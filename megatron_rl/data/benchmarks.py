"""Loaders for common benchmark formats, each to :class:`~megatron_rl.data.problems.Problem`.

- ``aime``: JSONL/CSV/Parquet of ``problem`` (or ``question``/``Problem``/``Question``) with an
  integer ``answer`` in 0..999 (or ``Answer``); AIME's answers are integers, so anything else is
  an input error naming the line.
- ``gpqa``: multiple choice, either ``{"question", "choices": [...], "answer": letter | index |
  option text}`` or GPQA's own columns (``Question``, ``Correct Answer``, ``Incorrect Answer
  1..3``), whose options are shuffled by a hash of ``(seed, id)`` (GPQA lists the right one
  first). The statement lists the options as ``(A) ...``; the reference is the letter, which the
  math verifier compares with ``\\boxed{B}``.
- ``lcb``: LiveCodeBench-style code problems: ``question_content``, ``public_test_cases`` and
  ``private_test_cases`` (lists, JSON strings, or LiveCodeBench's base64 + zlib + pickle
  encoding -- unpickled with a loader that refuses every class, so only plain data decodes);
  stdin tests only: problems with ``functional`` tests are skipped and counted.
- ``problems``: this project's own format (see :mod:`megatron_rl.data.problems`).

``auto`` picks the format from the first record's fields. Tiny made-up samples of each ship in
``megatron_rl/data/samples/`` (:func:`sample_file`).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.data.problems import DataError, Problem, problem_from_json, read_records
from megatron_rl.data.report import CurationReport

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = [
    "FORMATS",
    "detect_format",
    "load_aime",
    "load_benchmark",
    "load_gpqa",
    "load_livecodebench",
    "sample_file",
]

FORMATS = ("auto", "problems", "aime", "gpqa", "lcb")
LETTERS = "ABCDEFGHIJ"


def sample_file(name: str) -> Path:
    """Path of a sample shipped in ``megatron_rl/data/samples/`` (e.g. ``aime_sample.jsonl``)."""
    path = Path(str(files("megatron_rl.data") / "samples" / name))
    if not path.is_file():
        raise FileNotFoundError(f"no shipped sample named {name!r} in {path.parent}")
    return path


def _first(obj: dict[str, JsonValue], names: tuple[str, ...]) -> JsonValue:
    for n in names:
        if obj.get(n) not in (None, ""):
            return obj[n]
    return None


def _id(obj: dict[str, JsonValue], where: str) -> str:
    pid = _first(obj, ("id", "ID", "problem_id", "question_id", "Record ID"))
    return str(pid) if pid is not None else where.rsplit("/", 1)[-1]


def _meta(obj: dict[str, JsonValue], used: tuple[str, ...]) -> dict[str, JsonValue]:
    return {k: v for k, v in obj.items() if k not in used}


def load_aime(path) -> tuple[list[Problem], CurationReport]:
    report = CurationReport("load aime")
    out = []
    used = ("id", "ID", "problem_id", "problem", "question", "Problem", "Question", "answer", "Answer")
    for where, obj in read_records(path):
        report.total += 1
        text = _first(obj, ("problem", "question", "Problem", "Question"))
        if not isinstance(text, str):
            raise DataError(f"{where}: problem: missing (or question / Problem / Question)")
        raw = _first(obj, ("answer", "Answer"))
        try:
            value = int(str(raw).strip()) if not isinstance(raw, bool) else None
        except ValueError:
            value = None
        if value is None or not 0 <= value <= 999:
            raise DataError(f"{where}: answer: AIME answers are integers 0..999, got {raw!r}")
        out.append(
            Problem(
                id=_id(obj, where),
                problem=text,
                task="math",
                answer=str(value),
                lang=obj.get("lang"),
                meta=_meta(obj, used + ("lang",)),
            )
        )
        report.keep()
    return out, report


def _gpqa_options(obj: dict[str, JsonValue], where: str, seed: int) -> tuple[list[str], int]:
    """(options, index of the right one)."""
    if "choices" in obj:
        options = obj["choices"]
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
            raise DataError(f"{where}: choices: expected a list of two or more strings")
        ans = obj.get("answer")
        if isinstance(ans, int) and not isinstance(ans, bool) and 0 <= ans < len(options):
            return options, ans
        if isinstance(ans, str) and ans.strip().strip("()").upper() in LETTERS[: len(options)]:
            return options, LETTERS.index(ans.strip().strip("()").upper())
        if isinstance(ans, str) and ans in options:
            return options, options.index(ans)
        raise DataError(f"{where}: answer: expected a letter, an index or one of the choices, got {ans!r}")
    right = obj.get("Correct Answer")
    wrong = [w for i in (1, 2, 3) if isinstance(w := obj.get(f"Incorrect Answer {i}"), str)]
    if not isinstance(right, str) or len(wrong) != 3:
        raise DataError(f"{where}: choices: missing (or GPQA's 'Correct Answer' and 'Incorrect Answer 1..3')")
    options = [right.strip(), *(w.strip() for w in wrong)]
    # A fixed shuffle per problem: GPQA lists the right answer first.
    order = sorted(range(4), key=lambda i: zlib.crc32(f"{seed}:{_id(obj, where)}:{i}".encode()))
    return [options[i] for i in order], order.index(0)


def load_gpqa(path, *, seed: int = 0) -> tuple[list[Problem], CurationReport]:
    report = CurationReport("load gpqa")
    out = []
    used = (
        "id",
        "ID",
        "Record ID",
        "question",
        "Question",
        "choices",
        "answer",
        "Correct Answer",
        "Incorrect Answer 1",
        "Incorrect Answer 2",
        "Incorrect Answer 3",
        "lang",
    )
    for where, obj in read_records(path):
        report.total += 1
        text = _first(obj, ("question", "Question"))
        if not isinstance(text, str):
            raise DataError(f"{where}: question: missing (or Question)")
        options, right = _gpqa_options(obj, where, seed)
        listed = "\n".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(options))
        statement = (
            f"{text.strip()}\n\n{listed}\n\nGive the letter of the correct option as your final answer."
        )
        out.append(
            Problem(
                id=_id(obj, where),
                problem=statement,
                task="math",
                answer=LETTERS[right],
                lang=obj.get("lang"),
                meta={**_meta(obj, used), "choices_listed": options},
            )
        )
        report.keep()
    return out, report


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain data (str, bytes, numbers, lists, dicts); any class or function is refused,
    so a crafted file cannot run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data is allowed")


def _decode_tests(raw: JsonValue, where: str, field_name: str) -> list[dict[str, JsonValue]]:
    if raw in (None, ""):
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            try:
                blob = zlib.decompress(base64.b64decode(raw))
                raw = _DataOnlyUnpickler(io.BytesIO(blob)).load()
                raw = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
            except Exception as e:  # noqa: BLE001 -- any decoding failure is the record's fault
                raise DataError(
                    f"{where}: {field_name}: neither JSON nor base64+zlib+pickle ({type(e).__name__}: {e})"
                ) from None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise DataError(f"{where}: {field_name}: expected a list of test objects")
    return raw


def load_livecodebench(path) -> tuple[list[Problem], CurationReport]:
    report = CurationReport("load lcb")
    out = []
    used = ("question_id", "id", "question_content", "public_test_cases", "private_test_cases", "lang")
    for where, obj in read_records(path):
        report.total += 1
        text = obj.get("question_content")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: question_content: missing or empty")
        tests = _decode_tests(obj.get("public_test_cases"), where, "public_test_cases") + _decode_tests(
            obj.get("private_test_cases"), where, "private_test_cases"
        )
        if any(t.get("testtype", "stdin") != "stdin" for t in tests):
            report.drop("functional tests (stdin/stdout only)")
            continue
        if not tests:
            report.drop("no tests")
            continue
        for k, t in enumerate(tests):
            if not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
                raise DataError(f"{where}: tests[{k}]: needs string 'input' and 'output'")
        out.append(
            Problem(
                id=_id(obj, where),
                problem=text.strip(),
                task="code",
                tests=[{"input": t["input"], "output": t["output"]} for t in tests],
                lang=obj.get("lang"),
                meta=_meta(obj, used),
            )
        )
        report.keep()
    return out, report


def _load_problems(path) -> tuple[list[Problem], CurationReport]:
    report = CurationReport("load problems")
    out = [problem_from_json(obj, where) for where, obj in read_records(path)]
    report.total = report.kept = len(out)
    return out, report


def detect_format(path) -> str:
    """The format of ``path`` judged from its first record's fields."""
    for _, obj in read_records(path):
        keys = set(obj) if isinstance(obj, dict) else set()
        if "question_content" in keys:
            return "lcb"
        if "Correct Answer" in keys or ("choices" in keys and "question" in keys):
            return "gpqa"
        if "problem" in keys or "tests" in keys:
            return "problems"
        if keys & {"question", "Question", "Problem"} and keys & {"answer", "Answer"}:
            return "aime"
        break
    return "problems"


def load_benchmark(path, fmt: str = "auto", *, seed: int = 0) -> tuple[list[Problem], CurationReport]:
    """Problems of ``path`` in format ``fmt`` (one of :data:`FORMATS`); ids must be unique."""
    if fmt not in FORMATS:
        raise ValueError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    loader = {
        "problems": _load_problems,
        "aime": load_aime,
        "lcb": load_livecodebench,
        "gpqa": lambda p: load_gpqa(p, seed=seed),
    }[fmt]
    problems, report = loader(path)
    seen = set()
    for p in problems:
        if p.id in seen:
            raise DataError(f"{path}: id: {p.id!r} appears more than once")
        seen.add(p.id)
    return problems, report
