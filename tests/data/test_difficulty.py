"""Difficulty filtering on pre-scored completions: pass-rate bounds, and a wrong reference flagged
when most completions agree -- in different spellings -- on another answer."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigFieldError
from megatron_rl.data.difficulty import (
    DifficultyConfig,
    attempts_from_scored,
    cluster_answers,
    difficulty_filter,
    normalise_answer,
)
from megatron_rl.data.problems import DataError, Problem
from megatron_rl.data.sampling import Attempt
from megatron_rl.rewards.math import MathConfig


def tries(*pairs) -> list[Attempt]:
    """(answer, correct, count) triples -> attempts."""
    out = []
    for answer, correct, count in pairs:
        for _ in range(count):
            out.append(
                Attempt(
                    index=len(out),
                    completion="",
                    num_tokens=10,
                    finish_reason="stop",
                    reward=float(correct),
                    reason="ok" if correct else "wrong_answer",
                    correct=correct,
                    answer=answer,
                )
            )
    return out


PROBLEMS = [
    Problem(id=i, problem=f"problem {i}", answer=a)
    for i, a in [
        ("half", "4"),
        ("wrong-ref", "7"),
        ("easy", "1"),
        ("hard", "9"),
        ("unsampled", "2"),
        ("split", "3"),
        ("rare", "5"),
    ]
]
ATTEMPTS = {
    "half": tries(("4", True, 8), ("3", False, 4), (None, False, 4)),
    # 10 of 16 say six, spelled four ways: only the verifier sees one answer (exact match: 4 max).
    "wrong-ref": tries(
        ("7", True, 2),
        ("6", False, 4),
        ("6.0", False, 2),
        ("\\frac{12}{2}", False, 2),
        ("\\dfrac{18}{3}", False, 2),
        ("8", False, 4),
    ),
    "easy": tries(("1", True, 16)),
    "hard": tries(("2", False, 5), ("3", False, 5), (None, False, 6)),
    "split": tries(("3", True, 2), ("1", False, 7), ("2", False, 7)),  # no majority: 7/16 each
    "rare": tries(("5", True, 1), ("x", False, 15)),  # 15/16 agree on a wrong answer
}


def test_bounds_and_flags(pool):
    kept, details, report = difficulty_filter(PROBLEMS, ATTEMPTS, pool=pool, progress=False)
    d = {x.problem_id: x for x in details}
    assert [p.id for p in kept] == ["half", "split"]
    assert kept[0].meta == {"pass_rate": 0.5, "pass_samples": 16}
    assert d["wrong-ref"].flagged and d["wrong-ref"].majority_count == 10
    assert normalise_answer(d["wrong-ref"].majority_answer) in {"6", "6.0", "\\frac{12}{2}", "\\frac{18}{3}"}
    assert d["wrong-ref"].decision == "likely_wrong_reference"
    assert d["rare"].flagged and d["rare"].majority_answer == "x"
    assert not d["split"].flagged and not d["hard"].flagged and d["hard"].majority_count == 5
    assert (d["easy"].decision, d["hard"].decision, d["unsampled"].decision) == (
        "always_solved",
        "never_solved",
        "no_samples",
    )
    assert dict(report.dropped) == {
        "likely_wrong_reference": 2,
        "always_solved": 1,
        "never_solved": 1,
        "no_samples": 1,
    }
    assert report.kept == 2 and report.notes["flagged: majority answer differs from the reference"] == 2


def test_custom_bounds_and_keeping_flagged(pool):
    cfg = DifficultyConfig(low=0.1, high=0.9, drop_flagged=False)
    kept, _details, report = difficulty_filter(PROBLEMS, ATTEMPTS, cfg, pool=pool, progress=False)
    assert [p.id for p in kept] == ["half", "wrong-ref", "split"]  # 2/16 = 0.125 > 0.1
    assert report.dropped["too_hard (pass rate <= 0.1)"] == 2  # hard (0) and rare (1/16)
    assert report.dropped["too_easy (pass rate >= 0.9)"] == 1


def test_cluster_answers_merges_equivalent_spellings(pool):
    labels = pool.submit(cluster_answers, ["1/2", "0.5", "\\frac{1}{2}", "2", " 2 "], MathConfig()).result()
    assert labels[0] == labels[1] == labels[2] and labels[3] == labels[4] != labels[0]


def test_config_checks_name_the_field():
    with pytest.raises(ConfigFieldError, match="high: must be > low"):
        DifficultyConfig(low=0.5, high=0.5)
    with pytest.raises(ConfigFieldError, match="majority"):
        DifficultyConfig(majority=1.0)


def test_attempts_from_scored_reads_reward_cli_output(tmp_path):
    lines = [
        {
            "problem": "1+1?",
            "answer": "2",
            "group_id": "p1",
            "reason": "ok",
            "correct": True,
            "completion": "<think>a</think>\\boxed{2}",
        },
        {
            "problem": "1+1?",
            "answer": "2",
            "group_id": "p1",
            "reason": "wrong_answer",
            "completion": "<think>a</think>\\boxed{3}",
        },
        {"problem_id": "p2", "correct": False, "completion": "no format"},
    ]
    path = tmp_path / "scored.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = attempts_from_scored(str(path))
    assert [(a.correct, a.answer) for a in got["p1"]] == [(True, "2"), (False, "3")]
    assert [(a.correct, a.answer) for a in got["p2"]] == [(False, None)]
    path.write_text(json.dumps({"problem_id": "p", "completion": "x"}) + "\n")
    with pytest.raises(DataError, match=r"scored.jsonl:1: correct"):
        attempts_from_scored(str(path))
