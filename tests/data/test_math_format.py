"""Format filtering on the shipped sample of raw math problems, with the real math verifier."""

from __future__ import annotations

import pytest

from megatron_rl.data.benchmarks import sample_file
from megatron_rl.data.math_format import (
    MathFormatConfig,
    check_reference,
    find_options,
    format_filter,
    text_reason,
)
from megatron_rl.data.problems import Problem, read_problems
from megatron_rl.rewards.math import MathConfig


def test_the_sample_is_filtered_with_a_reason_per_drop(pool):
    problems = read_problems(sample_file("math_raw.jsonl"))
    kept, report = format_filter(problems, pool=pool, progress=False)
    by_id = {p.id: p for p in kept}
    assert list(by_id) == ["ok-1", "ok-2", "mc-amc", "mc-field", "code-1"]
    # Multiple choice became statement problems answered by the chosen option's text.
    assert by_id["mc-amc"].problem == "What is the value of $1+2+3+4$?"
    assert by_id["mc-amc"].answer == "10" and by_id["mc-amc"].meta["converted_from_multiple_choice"]
    assert (by_id["mc-field"].problem, by_id["mc-field"].answer, by_id["mc-field"].choices) == (
        "Compute $5^2$.",
        "25",
        None,
    )
    assert by_id["code-1"] == problems[-1]  # code passes through untouched
    assert report.total == 15 and report.kept == 5
    assert dict(report.dropped) == {
        "proof": 2,
        "multi_part": 2,
        "multiple_choice_needs_options": 1,
        "multiple_choice_bad_answer": 1,
        "textual_answer": 2,
        "unparsable_answer": 1,
        "missing_answer": 1,
    }
    assert report.notes == {"converted_multiple_choice": 2, "code_passed_through": 1}
    assert "dropped         2  proof" in report.summary()


def test_without_conversion_multiple_choice_is_dropped(pool):
    problems = read_problems(sample_file("math_raw.jsonl"))
    kept, report = format_filter(
        problems, MathFormatConfig(convert_multiple_choice=False), pool=pool, progress=False
    )
    assert {p.id for p in kept} == {"ok-1", "ok-2", "code-1"}
    assert report.dropped["multiple_choice"] == 4


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Let $f(A) = 2$. Find $f(A) + 1$.", None),  # a function of A is no option list
        ("Pick one.\nA. 12\nB. 15\nC. 18", {"A": "12", "B": "15", "C": "18"}),
        ("What is 1+1? (A) 1 (B) 2 (C) 3 (D) 4", {"A": "1", "B": "2", "C": "3", "D": "4"}),
        ("What is 1+1? (B) 2 (C) 3 (D) 4", None),  # the run must start at A
    ],
)
def test_find_options(text, expected):
    found = find_options(Problem(id="x", problem=text, answer="B"))
    assert (found and found[1]) == expected


@pytest.mark.parametrize(
    "text, answer, reason",
    [
        ("Find all real x with x^2 = 4.", "-2, 2", "ok"),  # a set answer is one part
        ("1. Find a.\n2. Find b.", "3", "multi_part"),
        ("Given:\n1. a = 2\n2. b = 3\nWhat is a + b?", "5", "ok"),  # numbered conditions, one question
        ("Part (a): find x. Part (b): find y.", "1", "multi_part"),
        ("Compute $f(a) + f(b)$ for $f(t) = t$, $a=1$, $b=2$.", "3", "ok"),  # f(a) is no sub-question
        ("What is the distance?", "12 \\text{ meters}", "ok"),  # units are fine
        ("Is 7 prime?", "True", "textual_answer"),
        ("Find $x$.", "x = 3; y = 4", "multi_part"),
    ],
)
def test_text_rules(text, answer, reason):
    assert text_reason(Problem(id="x", problem=text, answer=answer), MathFormatConfig())[1] == reason


def test_reference_check_uses_the_real_verifier(pool):
    cfg = MathConfig()
    ok = pool.submit(check_reference, "$\\frac{3}{4}$", cfg).result()
    broken = pool.submit(check_reference, "\\frac{", cfg).result()
    assert ok.correct and not broken.correct
