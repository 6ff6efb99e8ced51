import pytest

from megatron_rl.rewards.math import MathConfig, verify_math
from megatron_rl.rewards.pool import VerifierPool
from tests.rewards.math_pairs import EQUIVALENT, NOT_EQUIVALENT


def test_table_is_large_enough():
    assert len(EQUIVALENT) + len(NOT_EQUIVALENT) >= 60


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, preload=("megatron_rl.rewards.math",)) as p:
        yield p


def test_equivalent_and_non_equivalent_pairs(pool):
    # Through the pool, as in training: math-verify is not thread-safe, processes are.
    items = [(f"So the answer is $\\boxed{{{ans}}}$.", ref) for ref, ans in EQUIVALENT + NOT_EQUIVALENT]
    verdicts = pool.map(verify_math, items, timeout_s=30)
    expected = [True] * len(EQUIVALENT) + [False] * len(NOT_EQUIVALENT)
    wrong = [(items[i], v) for i, (v, e) in enumerate(zip(verdicts, expected)) if v.correct != e]
    assert not wrong
    assert all(v.reason == "wrong_answer" for v in verdicts[len(EQUIVALENT) :])


def test_gold_with_or_without_dollars():
    assert verify_math(r"\boxed{\frac{1}{2}}", "$0.5$").correct
    assert verify_math(r"\boxed{\frac{1}{2}}", "$$0.5$$").correct


def test_no_answer_and_unparsable():
    assert verify_math("no box here", "1").reason == "no_answer"
    assert verify_math(r"\boxed{ }", "1").reason == "no_answer"
    v = verify_math("\\boxed{" + "{" * 100 + "1" + "}" * 100 + "}", "1")
    assert v.reason == "unparsable_answer" and "deeper" in v.detail
    v = verify_math("\\boxed{" + "1+" * 5000 + "1}", "1")
    assert v.reason == "unparsable_answer" and "characters" in v.detail


@pytest.mark.parametrize("answer", [r"9^{9^{9}}", r"1000000!", r"10^{10^{10}}", r"(10^{100})!"])
def test_pathological_answers_return_within_their_limit(pool, answer):
    cfg = MathConfig(parse_timeout_s=1, verify_timeout_s=1)
    # The pool's hard limit is the backstop for work no signal can interrupt.
    (v,) = pool.map(verify_math, [(f"\\boxed{{{answer}}}", "3", cfg)], timeout_s=15)
    assert not getattr(v, "correct", False)
    assert getattr(v, "reason", None) in ("timeout", "unparsable_answer", "wrong_answer", "worker_timeout")
