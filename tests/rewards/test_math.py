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


def test_verdict_cache_skips_repeats_but_never_keeps_a_timeout(monkeypatch):
    """A group's repeated answers are verified once per process; a time-out (load-dependent)
    is verified again; the bound evicts the least recently used; 0 turns the cache off."""
    import megatron_rl.rewards.math as math_mod

    monkeypatch.setattr(math_mod, "_VERDICTS", math_mod.OrderedDict())
    real, calls = math_mod._verify_boxed, []

    def counted(boxed, reference, cfg):
        calls.append((boxed, reference))
        return real(boxed, reference, cfg)

    monkeypatch.setattr(math_mod, "_verify_boxed", counted)
    cfg = MathConfig(verdict_cache=2)
    first = verify_math(r"so \boxed{\frac{1}{2}}", "0.5", cfg)
    first.correct = False  # a caller editing its verdict does not edit the cache
    again = verify_math(r"other words, same \boxed{\frac{1}{2}}", "0.5", cfg)
    assert again.correct and again.reason == "ok" and len(calls) == 1
    verify_math(r"\boxed{\frac{1}{2}}", "0.5", MathConfig(float_rounding=0, verdict_cache=2))
    assert len(calls) == 2  # another float_rounding is another question
    verify_math(r"\boxed{3}", "4", cfg)  # the cache holds 2: the 1/2 vs 0.5 rounding-6 entry goes
    verify_math(r"\boxed{\frac{1}{2}}", "0.5", cfg)
    assert len(calls) == 4
    assert verify_math(r"\boxed{7}", "7", MathConfig(verdict_cache=0)).correct
    assert verify_math(r"\boxed{7}", "7", MathConfig(verdict_cache=0)).correct and len(calls) == 6

    timeout = math_mod.Verdict(False, 0.0, "timeout", "comparing timed out")
    monkeypatch.setattr(math_mod, "_verify_boxed", lambda b, r, c: calls.append(b) or timeout)
    assert verify_math(r"\boxed{x^x}", "1", cfg).reason == "timeout"
    assert verify_math(r"\boxed{x^x}", "1", cfg).reason == "timeout" and len(calls) == 8
