"""Benchmark loaders on the shipped samples (AIME-, GPQA-, LiveCodeBench-style)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import zlib

import pytest

from megatron_rl.data.benchmarks import detect_format, load_benchmark, sample_file
from megatron_rl.data.problems import DataError
from megatron_rl.rewards.code import CodeConfig, verify_code
from megatron_rl.rewards.math import verify_math


def test_aime_answers_are_integers():
    problems, report = load_benchmark(sample_file("aime_sample.jsonl"), "aime")
    assert [p.answer for p in problems] == ["19", "24", "81", "24"]
    assert problems[0].id == "made-up-2024-1" and problems[0].meta == {"year": 2024}
    assert report.kept == 4


def test_aime_rejects_a_non_integer_answer(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text(
        json.dumps({"question": "q", "answer": 3})
        + "\n"
        + json.dumps({"question": "q", "answer": "3/4"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"aime.jsonl:2: answer: AIME answers are integers"):
        load_benchmark(path, "aime")
    assert detect_format(path) == "aime"


def test_gpqa_json_and_csv(pool):
    problems, _ = load_benchmark(sample_file("gpqa_sample.jsonl"))
    assert [p.answer for p in problems] == ["B", "D", "B"]
    assert "(B) 20 m" in problems[0].problem and problems[0].meta["domain"] == "Physics"
    csv_problems, _ = load_benchmark(sample_file("gpqa_sample.csv"))
    for p, right in zip(csv_problems, ["Coulomb", "Mitochondrion"]):
        options = p.meta["choices_listed"]
        assert options[ord(p.answer) - ord("A")] == right and len(options) == 4
        assert f"({p.answer}) {right}" in p.problem
    assert load_benchmark(sample_file("gpqa_sample.csv"))[0] == csv_problems  # a fixed shuffle
    # The letter is checked by the real math verifier.
    assert verify_math("so \\boxed{B}", problems[0].answer).correct
    assert not verify_math("so \\boxed{C}", problems[0].answer).correct


def test_livecodebench_tests_decode_and_run():
    problems, report = load_benchmark(sample_file("livecodebench_sample.jsonl"))
    assert [p.id for p in problems] == ["lcb-made-up-1", "lcb-made-up-2"]
    assert report.dropped == {"functional tests (stdin/stdout only)": 1}
    assert problems[0].tests == [
        {"input": "3\n", "output": "6\n"},
        {"input": "0\n", "output": "0\n"},
        {"input": "-7\n", "output": "-14\n"},
    ]
    assert problems[0].task == "code" and problems[0].meta["platform"] == "atcoder"
    assert verify_code(
        "print(2 * int(input()))", "python", problems[0].tests, CodeConfig(test_timeout_s=2.0)
    ).correct


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil = base64.b64encode(zlib.compress(pickle.dumps(_Evil(marker)))).decode()
    path = tmp_path / "lcb.jsonl"
    path.write_text(
        json.dumps(
            {
                "question_id": "x",
                "question_content": "q",
                "public_test_cases": "[]",
                "private_test_cases": evil,
            }
        )
        + "\n"
    )
    with pytest.raises(DataError, match=r"lcb.jsonl:1: private_test_cases: .*refusing to load"):
        load_benchmark(path)
    assert not marker.exists()


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="format: must be one of"):
        load_benchmark(sample_file("aime_sample.jsonl"), "mmlu")
