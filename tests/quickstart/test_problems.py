"""The problem generator: deterministic, disjoint splits, and every reference answer right.

The answers are checked twice over: against the problem text itself (the expression evaluated,
the equation substituted back), and by the real reward on a correctly formatted trace.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from megatron_rl.config import ConfigFieldError
from megatron_rl.quickstart.problems import (
    KINDS,
    LEVELS,
    ProblemConfig,
    generate_problems,
    is_held_out,
    split_problems,
)
from megatron_rl.quickstart.sft import format_trace
from megatron_rl.rewards.compose import RewardConfig, RewardInput, score

_LINEAR = re.compile(r"Solve for x: (\d*)x ([+-]) (\d+) = (-?\d+)")
_ARITH = re.compile(r"What is ([\d +*-]+)\?")


def _independent_answer(text: str) -> int:
    """The answer worked out from the statement alone."""
    if m := _ARITH.fullmatch(text):
        return int(eval(m.group(1), {"__builtins__": {}}))  # digits and + - * only (the regex)
    m = _LINEAR.fullmatch(text)
    assert m, text
    a = int(m.group(1) or 1)
    b = int(m.group(3)) * (1 if m.group(2) == "+" else -1)
    c = int(m.group(4))
    assert (c - b) % a == 0, text
    return (c - b) // a


def test_generation_is_deterministic_and_seeded():
    cfg = ProblemConfig(count=500, seed=7)
    assert generate_problems(cfg) == generate_problems(ProblemConfig(count=500, seed=7))
    other = generate_problems(ProblemConfig(count=500, seed=8))
    assert [p.problem for p in other] != [p.problem for p in generate_problems(cfg)]


def test_problems_are_unique_and_cover_every_kind_and_level():
    problems = generate_problems(ProblemConfig(count=2000))
    assert len({p.problem for p in problems}) == len(problems)
    assert len({p.id for p in problems}) == len(problems)
    cover = Counter((p.kind, p.difficulty) for p in problems)
    assert set(cover) == {(k, lvl) for k in KINDS for lvl in LEVELS}


def test_difficulty_knob_selects_levels():
    easy = generate_problems(ProblemConfig(count=300, difficulty_weights=(1, 0, 0)))
    assert {p.difficulty for p in easy} == {1}
    only_linear = generate_problems(ProblemConfig(count=300, linear_fraction=1.0))
    assert {p.kind for p in only_linear} == {"linear"}
    with pytest.raises(ConfigFieldError, match="difficulty_weights"):
        ProblemConfig(difficulty_weights=(0, 0, 0))


def test_splits_never_share_a_problem_even_across_seeds():
    a_train, a_held = split_problems(generate_problems(ProblemConfig(count=3000, seed=0)), 0.1)
    b_train, b_held = split_problems(generate_problems(ProblemConfig(count=3000, seed=1)), 0.1)
    assert 0.05 < len(a_held) / (len(a_train) + len(a_held)) < 0.15
    train = {p.problem for p in a_train + b_train}
    held = {p.problem for p in a_held + b_held}
    assert not train & held
    # The two seeds do overlap (small numbers): the split must hold for shared problems too.
    assert {p.problem for p in a_train} & {p.problem for p in b_train}
    assert all(is_held_out(t, 0.1) for t in held)


def test_reference_answers_match_the_statement():
    for p in generate_problems(ProblemConfig(count=3000)):
        assert int(p.answer) == _independent_answer(p.problem), p


def test_reference_answers_pass_the_real_verifier_on_a_formatted_trace():
    problems = generate_problems(ProblemConfig(count=3000))
    sample = []
    for key in sorted({(p.kind, p.difficulty) for p in problems}):
        sample += [p for p in problems if (p.kind, p.difficulty) == key][:15]
    cfg = RewardConfig()
    for p in sample:
        r = score(
            RewardInput(problem=p.problem, completion=format_trace(p), task="math", answer=p.answer), cfg
        )
        assert r.correct and r.format_ok, (p, r)
        # and a wrong number in the box is caught
        wrong = format_trace(p).replace(f"{{{p.answer}}}", f"{{{int(p.answer) + 1}}}")
        r = score(RewardInput(problem=p.problem, completion=wrong, task="math", answer=p.answer), cfg)
        assert r.format_ok and not r.correct, (p, r)


def test_jsonl_round_trip(tmp_path):
    """The file the warm-up writes is what the RL loop's reader gets back."""
    from megatron_rl.data.problems import read_problems, write_problems

    problems = generate_problems(ProblemConfig(count=50))
    write_problems(tmp_path / "p.jsonl", (p.to_record() for p in problems))
    read = read_problems(str(tmp_path / "p.jsonl"))
    assert [(r.id, r.problem, r.answer, r.task) for r in read] == [
        (p.id, p.problem, p.answer, p.task) for p in problems
    ]
    assert all(r.meta == {"difficulty": p.difficulty} for r, p in zip(read, problems))
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically: no temporary left behind
