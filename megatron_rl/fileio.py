"""Files that are whole or absent, and JSONL read and written line by line: the one home for both.

- Atomic writes (:func:`atomic_path`, :func:`atomic_write_bytes` / ``_text`` / ``_json``,
  :func:`atomic_output_dir`): a sibling temporary file or folder, fsync'ed, then ``os.replace``-d
  over the target (atomic on POSIX within one filesystem) and the parent folder fsync'ed, so a
  reader -- or a run resumed after a crash -- sees the old version or the new one, never a part.
- JSONL (:func:`iter_jsonl`, :func:`read_jsonl`, :func:`write_jsonl`, :func:`append_jsonl`,
  :func:`truncate_jsonl`): every bad line is reported as ``file:line: what is wrong``
  (:class:`JsonlError`), a line that is not UTF-8 included; appends are flushed and fsync'ed.

- Outputs apart from inputs (:func:`check_output_apart`): an output path that is, contains or lies
  inside an input is refused before the first byte is written.

Layer 1: imports only :mod:`megatron_rl.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_rl.errors import InputError, OutputError

__all__ = [
    "JsonValue",
    "JsonlCut",
    "JsonlError",
    "LoneSurrogateError",
    "append_jsonl",
    "atomic_output_dir",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_output_apart",
    "fsync_dir",
    "fsync_tree",
    "iter_jsonl",
    "read_jsonl",
    "truncate_jsonl",
    "write_jsonl",
]

PathLike = str | os.PathLike[str]

#: A value parsed from JSON. ``Any``, as ``json.loads`` returns it: a JSON document has no static
#: shape, so each reader checks the fields it needs where it reads the record. Writers take
#: ``object`` instead (``json.dumps`` raises TypeError for what it cannot serialise).
JsonValue = Any


def fsync_dir(folder: PathLike) -> None:
    """fsync a folder, so that a rename inside it survives a crash (best effort)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on directories
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` for a writer that wants a file name (``savefig``,
    ``tmp.open("w")``); on success it is fsync'ed and replaces ``path``, on error it is removed and
    ``path`` is untouched. The parent folder is created if missing."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    # The suffix stays last so that writers choosing a format by extension (savefig) still can.
    tmp = final.with_name(f".{final.stem}.tmp-{secrets.token_hex(4)}{final.suffix}")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path``: readers see the old file or the new one, never a part."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: object, *, indent: int = 1) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as JSON with sorted keys (TypeError if not
    serialisable)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n")


def fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync_file(Path(root) / name)
        fsync_dir(root)


@contextlib.contextmanager
def atomic_output_dir(out: PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder next to ``out``; on success rename it to ``out``.

    Every file is fsync'ed before the rename, so a folder that exists after a crash is complete.
    On an exception the temporary folder is removed and ``out`` is untouched. ``out`` must not
    exist unless ``overwrite``: then the old folder is moved aside (``out`` is briefly absent)
    and removed once the new one is in place. Raises FileExistsError (naming ``out``) otherwise.
    """
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; remove it or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_output_apart(output: PathLike, inputs: Iterable[PathLike | None], *, what: str = "output") -> None:
    """Refuse an output that would write where the command reads, before the first byte.

    :class:`OutputError` when ``output`` is one of ``inputs`` (symlinks resolved, or the same file
    under another name: a hard link), lies inside an input folder, or is a folder that contains an
    input -- writing a temporary sibling and renaming it over the output would then replace or
    delete the input. ``None`` inputs (an option not given) are skipped.
    """
    out = Path(output).resolve()
    for given in inputs:
        if given is None:
            continue
        inp = Path(given).resolve()
        same = out == inp
        if not same and out.exists() and inp.exists():
            with contextlib.suppress(OSError):
                same = os.path.samefile(out, inp)
        if same:
            raise OutputError(
                f"{what} {output} is the input {given}: choose another path (the input is kept)"
            )
        if out.is_relative_to(inp):
            raise OutputError(f"{what} {output} lies inside the input {given}: choose a path outside it")
        if inp.is_relative_to(out):
            raise OutputError(
                f"{what} {output} contains the input {given}: writing it would replace the input"
            )


# -- JSONL -------------------------------------------------------------------------------------


#: Deepest nesting of arrays and objects a JSON record may have. Records here are flat (a sample,
#: a problem with its tests); the bound turns a hostile line of ``[[[[...`` into one clear error
#: instead of a RecursionError in the decoder or in whatever walks the value later.
MAX_JSON_DEPTH = 64


class JsonlError(InputError):
    """A bad line of a JSONL file; the message starts with ``file:line:``."""

    def __init__(self, path: PathLike, line: int, message: str):
        self.path, self.line, self.reason = str(path), line, message
        super().__init__(f"{path}:{line}: {message}")


def _refuse_constant(name: str) -> float:
    # json.loads accepts NaN, Infinity and -Infinity, which JSON itself does not: a reward, an
    # answer or a length that is NaN would pass every comparison silently downstream.
    raise ValueError(f"{name} is not a JSON number")


def json_depth(value: JsonValue) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), computed without recursion."""
    depth, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            depth = max(depth, d + 1)
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return depth


class LoneSurrogateError(ValueError):
    """Valid JSON whose string holds a lone surrogate: no text can be made of it."""


def _lone_surrogate(value: JsonValue) -> str | None:
    """Where a string of ``value`` holds a lone UTF-16 surrogate (``"\\ud800"`` escaped alone:
    JSON allows it, Unicode has no such character, and UTF-8 cannot encode it), e.g.
    ``field 'completion'``; None when there is none. Iterative, like :func:`json_depth`."""
    stack: list[tuple[JsonValue, str]] = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                char = f"\\u{ord(v[e.start]):04x}"
                return f"{where or 'the value'} holds a lone UTF-16 surrogate {char} (not a character)"
        elif isinstance(v, dict):
            stack.extend((x, f"field {k!r}" if not where else f"{where}.{k}") for k, x in v.items())
            stack.extend((k, f"a key of {where or 'the record'}") for k in v)
        elif isinstance(v, list):
            stack.extend((x, f"{where or 'the value'}[{i}]") for i, x in enumerate(v))
    return None


def loads_json(text: str, *, max_depth: int = MAX_JSON_DEPTH) -> JsonValue:
    """``json.loads`` that refuses NaN/Infinity, nesting deeper than ``max_depth`` and strings
    holding a lone surrogate (ValueError, json.JSONDecodeError is one)."""
    # The depth is checked only when the text could be that deep: one bracket per level.
    if text.count("[") + text.count("{") > max_depth:
        try:
            value = json.loads(text, parse_constant=_refuse_constant)
        except RecursionError:
            raise ValueError(f"nested deeper than {max_depth} levels") from None
        if json_depth(value) > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels")
    else:
        value = json.loads(text, parse_constant=_refuse_constant)
    # A surrogate can only come from a \u escape (decoded UTF-8 holds none): look only then.
    if "\\u" in text and (why := _lone_surrogate(value)) is not None:
        raise LoneSurrogateError(why)
    return value


def _decode(path: PathLike, lineno: int, raw: bytes) -> JsonValue:
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark, as Windows editors write it: not part of the JSON
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonlError(path, lineno, f"not UTF-8 (byte {e.start + 1} of the line)") from None
    try:
        return loads_json(text)
    except json.JSONDecodeError as e:
        raise JsonlError(path, lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
    except LoneSurrogateError as e:
        raise JsonlError(path, lineno, str(e)) from None
    except ValueError as e:
        raise JsonlError(path, lineno, f"invalid JSON: {e}") from None


def iter_jsonl(
    path: PathLike, *, objects: bool = True, skip_bad: bool = False, cut_tail: str = "raise"
) -> Iterator[tuple[int, JsonValue]]:
    """Yield ``(line_number, value)`` for every non-blank line of ``path`` (1-based numbers).

    A line that is not UTF-8, not JSON, or (``objects``) not a JSON object raises
    :class:`JsonlError`; with ``skip_bad`` the error is yielded as the value instead, so the
    caller can report it and go on. ``cut_tail="warn"`` ignores (with a warning) a last line that
    lacks its newline and does not parse: the mark of a writer killed mid-line.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file")
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                value = _decode(file, lineno, raw)
                if objects and not isinstance(value, dict):
                    raise JsonlError(file, lineno, f"expected a JSON object, got {type(value).__name__}")
            except JsonlError as e:
                if cut_tail == "warn" and not raw.endswith(b"\n"):
                    warnings.warn(
                        f"{file}:{lineno}: ignoring a cut-off last line (the writer was "
                        "interrupted mid-line)",
                        stacklevel=2,
                    )
                    return
                if not skip_bad:
                    raise
                value = e
            yield lineno, value


def read_jsonl(path: PathLike, *, cut_tail: str = "raise") -> list[dict[str, JsonValue]]:
    """Every record of ``path`` (see :func:`iter_jsonl`); raises on the first bad line."""
    return [obj for _, obj in iter_jsonl(path, cut_tail=cut_tail)]


def _lines(records: Iterable[object]) -> Iterator[str]:
    for r in records:
        yield json.dumps(r, ensure_ascii=False) + "\n"


def write_jsonl(path: PathLike, records: Iterable[object]) -> int:
    """Write one JSON value per line, atomically; returns the number of lines."""
    n = 0
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for line in _lines(records):
            f.write(line)
            n += 1
    return n


def append_jsonl(path: PathLike, records: Iterable[object]) -> int:
    """Append records, one JSON value per line, then flush and fsync; returns the lines written."""
    lines = list(_lines(records))
    if not lines:
        return 0
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    return len(lines)


@dataclasses.dataclass
class JsonlCut:
    """What :func:`truncate_jsonl` did to a file."""

    dropped: int = 0  # records ``keep`` refused
    torn: list[int] = dataclasses.field(default_factory=list)  # lines that did not parse (cut by a crash)
    restored: list[JsonValue] = dataclasses.field(default_factory=list)  # ``key`` of each record put back


def truncate_jsonl(
    path: PathLike,
    keep: Callable[[dict[str, JsonValue]], bool],
    *,
    restore: Iterable[dict[str, JsonValue]] = (),
    key: str = "step",
) -> JsonlCut:
    """Keep the records for which ``keep`` is true (atomic rewrite); lines that do not parse (a
    line cut by a crash) are dropped too. ``restore``: records kept elsewhere (a checkpoint's
    copy of the latest ones): each that ``keep`` accepts and whose ``key`` no kept record has
    is put back, and the file is then ordered by ``key`` (a torn line rewritten whole)."""
    file = Path(path)
    cut = JsonlCut()
    if not file.exists():
        return cut
    kept: list[dict[str, JsonValue]] = []
    for lineno, value in iter_jsonl(file, skip_bad=True):
        if isinstance(value, JsonlError):
            cut.torn.append(lineno)
        elif not keep(value):
            cut.dropped += 1
        else:
            kept.append(value)
    have = {r.get(key) for r in kept}
    for record in restore:
        if keep(record) and record.get(key) not in have:
            kept.append(record)
            have.add(record.get(key))
            cut.restored.append(record.get(key))
    if cut.restored:
        kept.sort(key=lambda r: (r.get(key) is None, r.get(key) or 0))
    atomic_write_bytes(
        file, b"".join(json.dumps(v, ensure_ascii=False).encode("utf-8") + b"\n" for v in kept)
    )
    return cut
