"""The whole reward, as the training loop and the CLI compute it (real verifiers, real pool)."""

import pytest

from megatron_rl.rewards.compose import RewardConfig, RewardInput, group_seed, score, score_many
from megatron_rl.rewards.pool import VerifierPool

EN_PROBLEM = "What is the sum of two and three? Give the exact value."
FR_PROBLEM = "Quelle est la somme de deux et trois ? Donne la valeur exacte."
EN_THINK = "<think>We need to add two and three together, which gives five in total.</think>"
FR_THINK = "<think>Il faut additionner deux et trois, ce qui donne cinq au total.</think>"


def math(completion, problem=EN_PROBLEM, **kw):
    return RewardInput(problem=problem, completion=completion, task="math", answer="5", **kw)


def test_correct_math_in_one_language_gets_everything():
    r = score(math(EN_THINK + "Adding the two numbers gives the result $\\boxed{5}$."), RewardConfig())
    assert r.reason == "ok" and r.correct and r.format_ok
    assert r.parts == pytest.approx({"format": 0.1, "correct": 0.9, "length": 0.0, "language": 0.1})
    assert r.reward == pytest.approx(1.1)
    assert r.info["languages"] == {"problem": "en", "thinking": "en", "answer": "en"}


def test_format_failure_is_zero_and_stops():
    r = score(math("The answer is $\\boxed{5}$ without thinking first."), RewardConfig())
    assert r.reward == 0.0 and r.reason == "format_error" and not r.format_ok
    assert "does not start" in r.detail


def test_wrong_answer_keeps_format_and_language():
    r = score(math(EN_THINK + "Adding the two numbers gives the result $\\boxed{6}$."), RewardConfig())
    assert r.reason == "wrong_answer" and r.reward == pytest.approx(0.2)


def test_language_mismatch_loses_only_the_bonus():
    r = score(
        math(EN_THINK + "Adding the two numbers gives the result $\\boxed{5}$.", problem=FR_PROBLEM),
        RewardConfig(),
    )
    assert r.correct and r.parts["language"] == 0.0 and r.reward == pytest.approx(1.0)
    r = score(
        math(FR_THINK + "En additionnant les deux nombres, on obtient $\\boxed{5}$.", problem=FR_PROBLEM),
        RewardConfig(),
    )
    assert r.parts["language"] == pytest.approx(0.1)


def test_length_penalty_enters_the_total():
    cfg = RewardConfig(l_max=1000, l_cache=200)
    r = score(math(EN_THINK + "Adding the two numbers gives the result $\\boxed{5}$.", num_tokens=900), cfg)
    assert r.parts["length"] == pytest.approx(-0.05) and r.reward == pytest.approx(1.05)
    r = score(math(EN_THINK + "Adding the two numbers gives the result $\\boxed{5}$.", num_tokens=5000), cfg)
    assert r.parts["length"] == pytest.approx(-0.1)


def test_code_reward_python_stdin():
    tests = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}]
    good = (
        EN_THINK
        + "Read both numbers and print their sum.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    )
    bad = (
        EN_THINK
        + "Read both numbers and print their sum.\n```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    )
    cfg = RewardConfig()
    r = score(
        RewardInput(problem=EN_PROBLEM, completion=good, task="code", tests=tests, language="python"), cfg
    )
    assert r.reason == "ok" and r.reward == pytest.approx(1.1)
    r = score(
        RewardInput(problem=EN_PROBLEM, completion=bad, task="code", tests=tests, language="python"), cfg
    )
    assert r.reason == "wrong_answer" and r.reward == pytest.approx(0.2)
    r = score(RewardInput(problem=EN_PROBLEM, completion=good, task="code", tests=tests, language="cpp"), cfg)
    assert r.reason == "wrong_answer" and "asks for 'cpp'" in r.detail


def test_group_seed_is_shared_by_a_group():
    a = RewardInput(problem="p", completion="x", task="math", answer="1", group_id=7)
    b = RewardInput(problem="q", completion="y", task="math", answer="1", group_id=7)
    c = RewardInput(problem="p", completion="z", task="math", answer="1")
    assert group_seed(a) == group_seed(b) != group_seed(c)


def test_invalid_inputs():
    """The built-in check needs its reference (a custom reward that replaces it may not)."""
    done = EN_THINK + "The sum is $\\boxed{5}$."
    with pytest.raises(ValueError, match="answer"):
        score(RewardInput(problem="p", completion=done, task="math"), RewardConfig())
    code = EN_THINK + "Here it is.\n```python\nprint(5)\n```"
    with pytest.raises(ValueError, match="tests"):
        score(RewardInput(problem="p", completion=code, task="code", tests=[]), RewardConfig())
    with pytest.raises(ValueError, match="task"):
        RewardInput(problem="p", completion="c", task="poetry")


def test_score_many_in_order_and_a_stuck_verifier_scores_zero():
    cfg = RewardConfig(task_timeout_s=4.0)
    cfg.math.parse_timeout_s = cfg.math.verify_timeout_s = 30  # let the pool's hard limit act
    good = math(EN_THINK + "Adding the two numbers gives the result $\\boxed{5}$.")
    stuck = math(EN_THINK + "Adding the two numbers gives the result $\\boxed{9^{9^{9}}}$.")
    with VerifierPool(2) as pool:
        results = score_many([good, stuck, good], cfg, pool)
    assert [r.reason for r in results] == ["ok", "worker_timeout", "ok"]
    assert results[1].reward == 0.0 and "hard limit" in results[1].detail
