"""pass@k against the exact binomial formula on known counts, maj@k ties, aggregation."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from megatron_rl.data.sampling import Attempt
from megatron_rl.evaluation.metrics import aggregate, default_ks, evaluate_problem, majority_score, pass_at_k


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize(
    "n, c, k, value",
    [
        (16, 0, 1, 0.0),
        (16, 1, 1, 1 / 16),
        (16, 16, 16, 1.0),
        (10, 3, 5, 1 - 21 / 252),
        (4, 2, 2, 1 - 1 / 6),
        (16, 15, 2, 1.0),  # n - c < k: every pair holds a correct one
    ],
)
def test_known_counts(n, c, k, value):
    assert pass_at_k(n, c, k) == pytest.approx(value, abs=1e-12)


def test_matches_the_exact_estimator_everywhere():
    for n in (1, 2, 5, 16, 33):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), abs=1e-12), (n, c, k)


def test_stable_where_binomials_overflow_floats():
    # C(2000, 1000) has 600 digits: the naive ratio in floats is inf / inf.
    assert pass_at_k(2000, 3, 1000) == pytest.approx(float(exact(2000, 3, 1000)), rel=1e-12)
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_score():
    assert majority_score([0, 0, 1, None, None, None], 0) == 1.0  # no-answers do not vote
    assert majority_score([0, 1, 1], 0) == 0.0
    assert majority_score([0, 1, 2, 2, 0, 1], 0) == pytest.approx(1 / 3)  # three-way tie
    assert majority_score([None, None], 0) == 0.0 and majority_score([1, 1], None) == 0.0


def att(correct: bool, n: int = 10, finish: str = "stop") -> Attempt:
    return Attempt(
        index=0,
        completion="",
        num_tokens=n,
        finish_reason=finish,
        reward=float(correct),
        reason="ok" if correct else "wrong_answer",
        correct=correct,
    )


def test_evaluate_and_aggregate():
    ks = default_ks(4)
    assert ks == [1, 2, 4]
    a = evaluate_problem(
        "a",
        "math",
        "en",
        [att(True, 10), att(False, 20), att(False, 30, "length"), att(True, 40)],
        ks,
        [0, 1, 1, 0],
    )
    b = evaluate_problem("b", "math", "fr", [att(False)] * 4, ks, [2, 2, 1, None])
    c = evaluate_problem("c", "code", "en", [att(True)] * 3 + [att(False)], ks)
    assert a.pass_at == pytest.approx({1: 0.5, 2: 1 - 1 / 6, 4: 1.0}) and a.maj == 0.5  # 2-2 tie
    assert b.maj == 0.0 and c.maj is None and a.truncated == 1
    s = aggregate([a, b, c], ks)
    assert s["overall"]["pass_at"]["1"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert s["overall"]["maj"] == pytest.approx(0.25) and s["overall"]["maj_problems"] == 2
    assert s["by_lang"]["fr"]["pass_at"]["4"] == 0.0 and s["by_task"]["code"]["pass_at"]["1"] == 0.75
    assert s["overall"]["length"]["correct"]["mean"] == pytest.approx((10 + 40 + 30) / 5)
    assert s["overall"]["truncated_share"] == pytest.approx(1 / 12)
    assert s["overall"]["reasons"] == {"wrong_answer": 7, "ok": 5}
    with pytest.raises(ValueError, match="share one cluster"):
        evaluate_problem("x", "math", "en", [att(True), att(True)], ks[:2], [0, 1])
