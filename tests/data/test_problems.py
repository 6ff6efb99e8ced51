"""Problem files: every supported layout reads to the same records, extra columns survive a
round trip, bad records name file, line and field, and writes are atomic."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.problems import DataError, Problem, read_problems, read_records, write_problems


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" if not isinstance(x, str) else x + "\n" for x in lines))
    return path


def test_roundtrip_keeps_unknown_fields_and_infers_task(tmp_path):
    src = _write(
        tmp_path / "in.jsonl",
        [
            {"id": "m", "problem": "1+1?", "answer": 2, "source": "web", "difficulty": {"pass": 0.5}},
            {"problem": "Echo.", "tests": [{"input": "a\n", "output": "a\n"}], "language": "python"},
        ],
    )
    problems = read_problems(src)
    assert [p.task for p in problems] == ["math", "code"]
    assert problems[0].answer == "2" and problems[0].meta == {"source": "web", "difficulty": {"pass": 0.5}}
    assert len(problems[1].id) == 12  # a hash of the statement: stable across runs
    assert read_problems(src)[1].id == problems[1].id
    write_problems(tmp_path / "out.jsonl", problems)
    again = read_problems(tmp_path / "out.jsonl")
    assert [p.to_json() for p in again] == [p.to_json() for p in problems]
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["source"] == "web"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"problem": "x", "answer": "1"', "invalid JSON"),
        ('{"answer": "1"}', "problem: missing"),
        ('{"problem": "x", "tests": [{"input": 3}]}', "tests[0].input: expected a string"),
        ('{"problem": "x", "task": "poetry"}', "task: must be 'math' or 'code'"),
        ('{"problem": "x", "answer": [1]}', "answer: expected a string or a number"),
        ('{"problem": "x", "tests": [], "solutions": [{"code": "print()"}]}', "solutions[0]"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, line, message):
    src = _write(tmp_path / "bad.jsonl", ['{"id": "ok", "problem": "1+1?", "answer": "2"}', "", line])
    with pytest.raises(DataError) as e:
        read_problems(src)
    assert str(e.value).startswith(f"{src}:3: ") and message in str(e.value)


def test_repeated_id_names_both_places(tmp_path):
    src = _write(
        tmp_path / "dup.jsonl",
        [{"id": 1, "problem": "a", "answer": "1"}, {"id": "1", "problem": "b", "answer": "2"}],
    )
    with pytest.raises(DataError, match=r"dup.jsonl:2: id: '1' already used at .*dup.jsonl:1"):
        read_problems(src)


def test_json_array_and_csv_layouts(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"id": "x", "problem": "p", "answer": "1"}]))
    assert read_problems(tmp_path / "a.json")[0].id == "x"
    (tmp_path / "b.csv").write_text('id,problem,answer\nx,"What is 1+1, really?",2\n')
    [p] = read_problems(tmp_path / "b.csv")
    assert (p.problem, p.answer) == ("What is 1+1, really?", "2")
    assert list(read_records(tmp_path / "b.csv"))[0][0].endswith("b.csv:2")
    with pytest.raises(DataError, match="no such file"):
        read_problems(tmp_path / "missing.jsonl")


def test_parquet_when_pyarrow_is_installed(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": ["a", "b"], "problem": ["1+1?", "2+2?"], "answer": ["2", "4"]}),
        tmp_path / "p.parquet",
    )
    assert [p.answer for p in read_problems(tmp_path / "p.parquet")] == ["2", "4"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "out.jsonl"
    write_problems(out, [{"a": 1}])

    def records():
        yield Problem(id="x", problem="p", answer="1")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_problems(out, records())
    assert out.read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
