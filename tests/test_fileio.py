"""megatron_rl.fileio: files are whole or absent, and every bad JSONL line is named by file:line."""

from __future__ import annotations

import json
import re

import pytest

from megatron_rl.fileio import (
    JsonlError,
    append_jsonl,
    atomic_output_dir,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    iter_jsonl,
    read_jsonl,
    truncate_jsonl,
    write_jsonl,
)


@pytest.mark.fault("crash")
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "f.json"
    atomic_write_json(out, {"a": 1})

    def records():
        yield {"b": 2}
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_jsonl(out, records())
    with pytest.raises(TypeError):
        atomic_write_json(out, {"x": object()})  # not serialisable: nothing written
    assert json.loads(out.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_atomic_path_keeps_the_suffix_for_format_sniffing_writers(tmp_path):
    with atomic_path(tmp_path / "sub" / "plot.png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path / "sub"
        tmp.write_bytes(b"png")
    assert (tmp_path / "sub" / "plot.png").read_bytes() == b"png"


@pytest.mark.fault("crash")
def test_atomic_output_dir_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "model"
    with atomic_output_dir(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(FileExistsError, match="model exists"):
        with atomic_output_dir(out):
            pass
    with pytest.raises(RuntimeError), atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in out.iterdir()) == ["a"]  # the old folder, untouched
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.fault("input")
def test_every_kind_of_bad_line_is_named_by_file_and_line(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"ok": 1}\n\n{not json\n\xff\xfe\n[1, 2]\n{"ok": 2}\n')
    with pytest.raises(JsonlError, match=r"in.jsonl:3: invalid JSON"):
        read_jsonl(f)
    got = list(iter_jsonl(f, skip_bad=True))
    assert [n for n, _ in got] == [1, 3, 4, 5, 6]
    errors = {n: str(v) for n, v in got if isinstance(v, JsonlError)}
    assert "in.jsonl:4: not UTF-8" in errors[4] and "expected a JSON object, got list" in errors[5]
    assert [v for _, v in got if isinstance(v, dict)] == [{"ok": 1}, {"ok": 2}]
    with pytest.raises(FileNotFoundError, match="missing.jsonl: no such file"):
        read_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.fault("crash")
def test_a_line_cut_by_a_crash_is_ignored_only_at_the_end(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"step": 1}\n{"step": 2')  # the writer died mid-line
    with pytest.warns(UserWarning, match="m.jsonl:2: ignoring a cut-off last line"):
        assert read_jsonl(f, cut_tail="warn") == [{"step": 1}]
    with pytest.raises(JsonlError, match="m.jsonl:2"):
        read_jsonl(f)
    f.write_text('{"step": 1\n{"step": 2}\n')  # not the last line: an error even with cut_tail
    with pytest.raises(JsonlError, match="m.jsonl:1"):
        read_jsonl(f, cut_tail="warn")


def test_append_then_truncate_back_to_a_step(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert append_jsonl(f, []) == 0 and not f.exists()
    append_jsonl(f, [{"step": s, "loss": s / 10} for s in range(1, 6)])
    with f.open("a") as fh:
        fh.write('{"step": 6, "lo')  # cut by a kill -9
    cut = truncate_jsonl(f, lambda r: r["step"] <= 3)
    assert (cut.dropped, cut.torn, cut.restored) == (2, [6], [])  # steps 4, 5 and the cut line
    assert [r["step"] for r in read_jsonl(f)] == [1, 2, 3]
    atomic_write_text(f, "")
    assert read_jsonl(f) == [] and truncate_jsonl(tmp_path / "none.jsonl", bool).dropped == 0


def test_truncate_puts_back_a_torn_record_from_a_copy(tmp_path):
    """A line torn in the middle of the file (step 8 of 10) is cut and rewritten whole from the
    copy a checkpoint kept, in its place; records the copy has and the file keeps stay as they are."""
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": s / 10} for s in range(1, 11)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    torn = text.replace(json.dumps(rows[7]), json.dumps(rows[7])[:9])  # step 8 cut mid-line
    f.write_text(torn)
    cut = truncate_jsonl(f, lambda r: r["step"] <= 10, restore=rows[6:])  # the checkpoint's copy: 7..10
    assert cut.torn == [8] and cut.restored == [8] and cut.dropped == 0
    assert read_jsonl(f) == rows


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "line, where",
    [
        ('{"completion": "a\\ud800b"}', "field 'completion'"),
        ('{"problem": {"tests": ["ok", "\\udfff"]}}', "field 'problem'.tests[1]"),
        ('{"\\ud83d": 1}', "a key of the record"),
    ],
)
def test_a_lone_surrogate_is_named_by_file_line_and_field(tmp_path, line, where):
    f = tmp_path / "in.jsonl"
    f.write_text('{"ok": "\\u00e9 \\ud83d\\ude00"}\n' + line + "\n")  # a pair is a character: fine
    with pytest.raises(JsonlError, match=rf"in.jsonl:2: {re.escape(where)} holds a lone UTF-16 surrogate"):
        read_jsonl(f)
    got = list(iter_jsonl(f, skip_bad=True))
    assert got[0] == (1, {"ok": "\u00e9 \U0001f600"}) and isinstance(got[1][1], JsonlError)
