"""The run directory's samples.jsonl: what the loop writes reads back; bad lines are named."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.problems import DataError
from megatron_rl.data.rundir import Sample, SampleWriter, read_samples


def sample(step=1, pid="p1", correct=True, **kw) -> Sample:
    base = dict(
        step=step,
        prompt_id=pid,
        problem="1+1?",
        task="math",
        prompt_ids=[5, 6, 7],
        completion_ids=[8, 9],
        completion="<think>x</think>\\boxed{2}",
        reward=1.0,
        parts={"format": 0.1, "correct": 0.9},
        reason="ok" if correct else "wrong_answer",
        correct=correct,
        versions=[0, 1],
    )
    return Sample(**{**base, **kw})


def test_writer_and_reader_roundtrip(tmp_path):
    run = tmp_path / "run"
    with SampleWriter(run) as w:
        w.write(sample(1))
        w.write_many([sample(2, "p2", False), sample(3, correct=None, reason="worker_timeout")])
    with SampleWriter(run) as w:  # a resumed run appends
        w.write(sample(4))
    got = list(read_samples(run))
    assert [s.step for s in got] == [1, 2, 3, 4]
    assert got[1] == sample(2, "p2", False) and got[2].correct is None
    assert list(read_samples(run / "samples.jsonl")) == got


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step": -1}, "step: expected a non-negative integer"),
        ({"task": "chat"}, "task: expected 'math' or 'code'"),
        ({"reason": "bad luck, see log"}, "reason: expected one of ok, format_error"),
        ({"versions": [0]}, "versions: 1 entries for 2 completion tokens"),
        ({"prompt_ids": []}, "prompt_ids: expected a non-empty list"),
        ({"correct": "yes"}, "correct: expected true, false or null"),
    ],
)
def test_a_bad_line_names_file_line_and_field(tmp_path, change, message):
    good = sample().to_json()
    bad = {**good, **change}
    (tmp_path / "samples.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError) as e:
        list(read_samples(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'samples.jsonl'}:2: ") and message in str(e.value)


def test_from_the_loops_typed_records(tmp_path):
    from megatron_rl.types import Completion, Prompt, ScoredCompletion

    prompt = Prompt(prompt_id="p9", token_ids=[1, 2], text="2+2?", task="math", answer="4")
    done = Completion(
        prompt_id="p9",
        sample_index=0,
        token_ids=[3, 4, 5],
        logprobs=[-0.1] * 3,
        versions=[6, 6, 7],
        text="<think>a</think>\\boxed{4}",
    )
    s = Sample.from_scored(
        7,
        prompt,
        ScoredCompletion(completion=done, reward=1.0, reason="ok", parts={"format": 0.1}, correct=True),
    )
    with SampleWriter(tmp_path) as w:
        w.write(s)
    [back] = read_samples(tmp_path)
    assert back == s and (back.step, back.versions, back.problem) == (7, [6, 6, 7], "2+2?")


def test_missing_field_is_named(tmp_path):
    obj = sample().to_json()
    del obj["reward"]
    (tmp_path / "samples.jsonl").write_text(json.dumps(obj) + "\n")
    with pytest.raises(DataError, match=r"samples.jsonl:1: reward: missing"):
        list(read_samples(tmp_path))


def test_a_cut_off_last_line_is_skipped_with_a_warning_but_not_a_bad_middle_line(tmp_path):
    line = json.dumps(sample().to_json())
    (tmp_path / "samples.jsonl").write_text(line + "\n" + line[:40])
    with pytest.warns(UserWarning, match="cut-off last line"):
        assert len(list(read_samples(tmp_path))) == 1
    (tmp_path / "samples.jsonl").write_text(line[:40] + "\n" + line + "\n")
    with pytest.raises(DataError, match=r":1: invalid JSON"):
        list(read_samples(tmp_path))
    with pytest.raises(DataError, match="no such file"):
        list(read_samples(tmp_path / "nowhere"))
