"""Your own data: column names of your own, in Parquet or a ``datasets`` folder saved with
``save_to_disk``, read into the same problems as the equivalent JSONL; bad rows name the file,
the row and your column; the recipe's filter, limit, splits and hold-out behave as documented
(docs/data.md "Use your own data", whose snippets run here); and the quick start's recipe trains on
such data with nothing else changed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError
from megatron_rl.data.problems import DataError, read_problems
from megatron_rl.orchestration.config import DataConfig
from megatron_rl.orchestration.problem_sets import read_problem_sets
from megatron_rl.orchestration.recipe import load_config
from tests.docs_pages import section

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = {"problem": "question", "answer": "final_answer", "id": "uid", "difficulty": "level"}
TESTS = [{"input": "1\n", "output": "2\n"}, {"input": "5\n", "output": "6\n"}]


def _ours() -> list[dict]:
    """Problems in our own field names (math and code, an extra column, a nested one)."""
    math = [
        {"id": f"m{i}", "problem": f"What is {i} + 4?", "answer": str(i + 4), "difficulty": i / 10}
        for i in range(6)
    ]
    code = {
        "id": "c0",
        "problem": "Read n, print n+1.",
        "task": "code",
        "tests": TESTS,
        "language": "python",
        "difficulty": 0.5,
    }
    return [{**r, "source": "web", "judge": {"model": "x"}} for r in [*math, code]]


def _theirs(records: list[dict]) -> list[dict]:
    """The same records under the user's column names (every row has every column, as a table
    does: null where a field does not apply)."""
    back = {ours: theirs for ours, theirs in COLUMNS.items()}
    keys = sorted({k for r in records for k in r})
    return [{back.get(k, k): r.get(k) for k in keys} for r in records]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _folder(path: Path, splits: dict[str, list[dict]] | list[dict]) -> Path:
    """A ``Dataset`` (rows) or ``DatasetDict`` (split -> rows) written by ``save_to_disk``."""
    if isinstance(splits, dict):
        ds = datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})
    else:
        ds = datasets.Dataset.from_list(splits)
    ds.save_to_disk(str(path))
    return path


def _drop_nulls(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if v is not None} for r in records]


def test_parquet_and_datasets_folders_read_into_the_same_problems_as_the_jsonl(tmp_path):
    ours, theirs = _ours(), _theirs(_ours())
    expected = read_problems(_jsonl(tmp_path / "ours.jsonl", ours), scorable=True)
    assert expected[6].task == "code" and expected[6].tests == TESTS
    assert expected[0].meta == {"difficulty": 0.0, "source": "web", "judge": {"model": "x"}}
    inputs = {
        "parquet": _parquet(tmp_path / "theirs.parquet", theirs),
        "jsonl": _jsonl(tmp_path / "theirs.jsonl", _drop_nulls(theirs)),
        "dataset": _folder(tmp_path / "dataset", theirs),
        "dataset_dict": _folder(tmp_path / "dataset_dict", {"train": theirs, "test": theirs[:2]}),
    }
    for name, path in inputs.items():
        # A table gives every row every column (null where a field does not apply): the same
        # problems all the same.
        assert read_problems(path, columns=COLUMNS, scorable=True) == expected, name
    # The unmapped columns stay in meta, under the user's names; the mapped ones are gone.
    p = read_problems(inputs["parquet"], columns=COLUMNS)[0]
    assert p.meta["source"] == "web" and "question" not in p.meta and p.meta["difficulty"] == 0.0
    # A nested column (dotted) is copied out of its parent.
    [q] = read_problems(
        _jsonl(tmp_path / "nested.jsonl", [{"q": "1+1?", "reward_model": {"ground_truth": 2}}]),
        columns={"problem": "q", "answer": "reward_model.ground_truth"},
    )
    assert (q.problem, q.answer, q.meta) == ("1+1?", "2", {"reward_model": {"ground_truth": 2}})


def test_a_bad_row_names_the_file_the_row_and_the_users_column(tmp_path):
    # A column of lists of answers, say, where the reward needs one: null in the other rows.
    rows = [{**r, "final_answer": [3, 4] if i == 2 else None} for i, r in enumerate(_theirs(_ours())[:4])]
    cases = {
        _parquet(tmp_path / "bad.parquet", rows): f"{tmp_path / 'bad.parquet'}:row 2",
        _folder(tmp_path / "bad_dd", {"train": rows}): f"{tmp_path / 'bad_dd' / 'train'}:row 2",
        _jsonl(tmp_path / "bad.jsonl", rows): f"{tmp_path / 'bad.jsonl'}:3",
    }
    for path, where in cases.items():
        with pytest.raises(DataError) as e:
            read_problems(path, columns=COLUMNS)
        assert str(e.value) == (
            f"{where}: answer (column 'final_answer'): expected a string or a number, got [3, 4]"
        )
    # A missing statement and an unscorable row (null answer) name the column as well.
    rows = _theirs(_ours())[:4]
    rows[2] = {**rows[2], "final_answer": None, "question": ""}
    with pytest.raises(DataError, match=r"empty.parquet:row 2: problem \(column 'question'\): missing"):
        read_problems(_parquet(tmp_path / "empty.parquet", rows), columns=COLUMNS)
    rows[2] = {**rows[2], "question": "What?"}
    with pytest.raises(DataError, match=r"row 2: answer \(column 'final_answer'\): a math problem needs"):
        read_problems(_parquet(tmp_path / "null.parquet", rows), columns=COLUMNS, scorable=True)
    # A record holding both the mapped column and one named like our field: one would be lost.
    both = _jsonl(tmp_path / "both.jsonl", [{"question": "a?", "problem": "b?", "final_answer": 1}])
    with pytest.raises(DataError, match=r"both.jsonl:1: problem: column 'question' is mapped to problem"):
        read_problems(both, columns=COLUMNS)


@pytest.mark.parametrize(
    "columns, message",
    [
        ("{question: problem}", "data.columns.question: not a field of a problem (map one of: id, problem,"),
        ("{problem: q, answer: q}", "data.columns.answer: column 'q' is already mapped to problem"),
        ("{problem: ''}", "data.columns.problem: expected the name of a column, got ''"),
        ("[problem]", "data.columns: expected a mapping"),
    ],
)
def test_a_bad_mapping_is_refused_at_load_naming_its_line(tmp_path, columns, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"loop:\n  max_steps: 1\ndata:\n  train: x.jsonl\n  columns: {columns}\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert str(e.value).startswith(f"{recipe}:5: {message}")


def _cfg(**fields) -> DataConfig:
    return DataConfig(**{"columns": dict(COLUMNS), **fields})


def test_where_limit_and_splits(tmp_path):
    rows = [
        {"uid": i, "question": f"{i} + 1?", "final_answer": i + 1, "source": src, "level": i % 3}
        for i, src in enumerate(["gsm8k", "math", "web", "gsm8k", "math", "web"])
    ]
    parquet = _parquet(tmp_path / "t.parquet", rows)
    ids = lambda ps: [p.id for p in ps]
    train, held = read_problem_sets(_cfg(train=str(parquet), where={"source": ["gsm8k", "math"]}))
    assert ids(train) == ["0", "1", "3", "4"] and held is None
    # Two columns: both must match; a value of another type matches by its text (CSV cells).
    (tmp_path / "t.csv").write_text("uid,question,final_answer,source,level\n1,a?,1,web,0\n2,b?,2,math,1\n")
    train, _ = read_problem_sets(_cfg(train=str(tmp_path / "t.csv"), where={"uid": 2, "source": "math"}))
    assert ids(train) == ["2"]
    train, _ = read_problem_sets(_cfg(train=str(parquet), where={"level": 0}, limit=1))
    assert ids(train) == ["0"]
    with pytest.raises(
        DataError, match=r"^data.where.sourse: no record of .*t.parquet has a column 'sourse'"
    ):
        read_problem_sets(_cfg(train=str(parquet), where={"sourse": "web"}))
    with pytest.raises(DataError, match=r"^data.where: no record of .* matches \{'source': 'arxiv'\}"):
        read_problem_sets(_cfg(train=str(parquet), where={"source": "arxiv"}))
    with pytest.raises(ConfigError, match=r"data.where.source: expected a value or a non-empty list"):
        load_config(None, ["data.where.source=[]"])

    folder = _folder(tmp_path / "dd", {"train": rows, "test": rows[:2]})
    train, held = read_problem_sets(_cfg(train=str(folder), eval=str(folder), eval_split="test"))
    assert (len(train), ids(held)) == (6, ["0", "1"])  # train: the "train" split by default
    with pytest.raises(DataError, match=r"^data.eval_split: .*dd holds several splits \(test, train\)"):
        read_problem_sets(_cfg(train=str(folder), eval=str(folder)))
    with pytest.raises(DataError, match=r"^data.split: .*dd has no split 'validation' \(its splits: test"):
        read_problem_sets(_cfg(train=str(folder), split="validation"))
    with pytest.raises(DataError, match=r"^data.split: 'train' given, but .*t.parquet is a file"):
        read_problem_sets(_cfg(train=str(parquet), split="train"))
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        read_problem_sets(_cfg(train=str(tmp_path)))


def test_eval_fraction_holds_out_a_seeded_set_independent_of_the_file_order(tmp_path):
    records = [
        {"uid": f"p{i}", "question": f"{i} + 1?", "final_answer": i + 1, "level": 0} for i in range(40)
    ]
    forward = _jsonl(tmp_path / "f.jsonl", records)
    backward = _jsonl(tmp_path / "b.jsonl", records[::-1])
    train, held = read_problem_sets(_cfg(train=str(forward), eval_fraction=0.1))
    assert len(held) == 4 and len(train) == 36
    assert {p.id for p in train}.isdisjoint(p.id for p in held)
    assert [p.id for p in train] == [r["uid"] for r in records if r["uid"] not in {p.id for p in held}]
    again = read_problem_sets(_cfg(train=str(backward), eval_fraction=0.1))[1]
    assert sorted(p.id for p in again) == sorted(p.id for p in held)
    other = read_problem_sets(_cfg(train=str(forward), eval_fraction=0.1, holdout_seed=1))[1]
    assert {p.id for p in other} != {p.id for p in held}
    # The limit applies first: 10 problems read, 1 held out.
    train, held = read_problem_sets(_cfg(train=str(forward), limit=10, eval_fraction=0.1))
    assert (len(train), len(held)) == (9, 1)
    with pytest.raises(DataError, match="data.eval_fraction: holding out 0.9 of 1 problems leaves none"):
        read_problem_sets(_cfg(train=str(forward), limit=1, eval_fraction=0.9))
    with pytest.raises(ConfigError, match="data.eval_fraction: holds part of train out when eval is empty"):
        load_config(None, ["data.train=a.jsonl", "data.eval=b.jsonl", "data.eval_fraction=0.1"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction: must be in \[0.0, 1.0\)"):
        load_config(None, ["data.eval_fraction=1"])


def _page_snippets() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", section("data.md", "## Use your own data"), re.S)


def test_the_documented_recipes_read_the_data_they_describe(tmp_path, monkeypatch):
    """Every YAML snippet of docs/data.md "Use your own data" loads (paths checked) and reads the
    files this test writes under the names the snippets use."""
    rows = [
        {"uid": f"u{i}", "question": f"What is {i} + 1?", "final_answer": str(i + 1), "source": src}
        for i, src in enumerate(["gsm8k", "math", "web"] * 20)
    ]
    monkeypatch.chdir(tmp_path)
    Path("my_data").mkdir()
    _parquet(Path("my_data/train.parquet"), rows)
    _folder(Path("my_data/saved"), {"train": rows[:50], "test": rows[50:]})
    snippets = _page_snippets()
    assert len(snippets) >= 2
    sizes = []
    for i, snippet in enumerate(snippets):
        recipe = tmp_path / f"snippet{i}.yaml"
        recipe.write_text(snippet)
        cfg = load_config(recipe, paths=True)
        train, held = read_problem_sets(cfg.data)
        assert train and held, f"snippet {i}"
        assert all(p.problem.startswith("What is") and p.answer for p in train + held)
        sizes.append((len(train), len(held)))
    # The first snippet: gsm8k + math rows (40), 5% held out; the second: the two splits.
    assert sizes[:2] == [(38, 2), (50, 10)]


# ---------------------------------------------------------------- the quick start, end to end


def _train_rows() -> list[dict]:
    """Problems the answering model (it writes \\boxed{4} three times in four, else \\boxed{5})
    gets right with probability 0.75 or 0.25: groups with different rewards."""
    return [
        {"uid": f"q{i}-{j}", "question": f"What is {i} + {4 - i}? ({j})", "final_answer": 4 if j else 5}
        for i in range(5)
        for j in range(4)
    ]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["parquet", "datasets"])
def test_the_quick_start_recipe_trains_on_your_own_data(tmp_path, layout):
    from tests.data.tinylm import answering_model, tiny_train_command

    answering_model(tmp_path / "model")
    rows = _train_rows()
    if layout == "parquet":
        train = _parquet(tmp_path / "train.parquet", rows)
    else:
        train = _folder(tmp_path / "saved", {"train": rows, "test": rows[:2]})
    run = tmp_path / "run"
    cmd = tiny_train_command(
        tmp_path / "model",
        run,
        2,
        "run.eval_k=1",
        # Your data.
        f"data.train={train}",
        "data.columns={problem: question, answer: final_answer, id: uid}",
        "data.eval_fraction=0.2",
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["pass@1_before"] is not None
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["label"], e["problems"]) for e in evals] == [("before", 4), ("after", 4)]
    trained = {
        json.loads(x)["prompt_id"]
        for x in (run / "ledger.jsonl").read_text().splitlines()
        if json.loads(x)["event"] == "trained"
    }
    assert trained and trained <= {r["uid"] for r in rows}  # your ids
    held_out = {p.id for p in read_problem_sets(load_config(run / "config.yaml").data)[1]}
    assert len(held_out) == 4 and trained.isdisjoint(held_out)
    # The prompts went through the tokenizer's chat template with the recipe's system prompt.
    from megatron_rl.data.sampling import load_tokenizer

    tok = load_tokenizer(str(tmp_path / "model"))
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    question = next(r["question"] for r in rows if r["uid"] == sample["prompt_id"])
    assert sample["problem"] == question
    assert tok.decode(sample["prompt_ids"]).startswith(
        f"<|system|>Think inside <think> </think>, then answer.<|user|>{question}\n\n"
    )


def test_a_resume_that_changes_which_problems_are_read_is_refused(tmp_path):
    from megatron_rl.config import config_to_dict
    from megatron_rl.orchestration.run_records import check_resume_config

    snapshot = tmp_path / "config.yaml"
    old = config_to_dict(load_config(None, ["data.train=t.parquet"]))
    snapshot.write_text(yaml.safe_dump(old))
    check_resume_config(snapshot, old)  # unchanged: resumes
    for override in ("data.columns.problem=question", "data.where.source=web", "data.limit=5"):
        new = config_to_dict(load_config(None, ["data.train=t.parquet", override]))
        key = override.split("=")[0]
        with pytest.raises(ValueError, match=rf"resuming with a different {re.escape(key)} "):
            check_resume_config(snapshot, new)
    # The prompt rendering may change (it is reported, not refused).
    check_resume_config(
        snapshot, config_to_dict(load_config(None, ["data.train=t.parquet", "data.chat_template=none"]))
    )
