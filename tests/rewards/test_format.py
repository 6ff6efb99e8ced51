import pytest

from megatron_rl.rewards.format import check_format, last_boxed
from megatron_rl.rewards.template import SYSTEM_PROMPT, build_messages


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed{3}", "3"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are literal
        (r"\boxed {x^{2^{3}}}", r"x^{2^{3}}"),
        (r"\boxed{1} and a broken \boxed{2", None),  # the last box is unclosed
        (r"\boxed", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_deep_nesting_is_linear():
    text = "\\boxed{" + "{" * 100_000 + "}" * 100_000 + "}"
    assert len(last_boxed(text)) == 200_000


@pytest.mark.parametrize(
    "completion, task, ok, why",
    [
        ("<think>hmm</think>The answer is $\\boxed{2}$.", "math", True, ""),
        ("  <think>hmm</think>\\boxed{2}", "math", True, ""),
        ("hmm</think>\\boxed{2}", "math", False, "does not start"),
        ("<think>hmm\\boxed{2}", "math", False, "exactly one"),
        ("<think>a</think>b</think>\\boxed{2}", "math", False, "exactly one"),
        ("<think>a<think>b</think>\\boxed{2}", "math", False, "exactly one"),
        ("<think>\\boxed{2}</think>The answer is 2.", "math", False, "boxed"),  # box only in thinking
        ("<think>x</think>```python\nprint(1)\n```", "code", True, ""),
        ("<think>x</think>```\nprint(1)\n```", "code", False, "language"),
        ("<think>```python\nprint(1)\n```</think>done", "code", False, "language"),
    ],
)
def test_check_format(completion, task, ok, why):
    parsed, reason = check_format(completion, task)
    assert (parsed is not None) == ok
    assert why in reason
    if ok:
        assert "<think>" not in parsed.answer


def test_system_prompt_and_messages():
    assert "inner monologue" in SYSTEM_PROMPT and "same language" in SYSTEM_PROMPT
    assert "as casual and as long as you want until you are confident" in SYSTEM_PROMPT
    assert "<think>" in SYSTEM_PROMPT and "</think>" in SYSTEM_PROMPT
    msgs = build_messages("What is 1+1?", "math")
    assert msgs[0]["role"] == "system" and "\\boxed{}" in msgs[1]["content"]
    with pytest.raises(ValueError):
        build_messages("x", "poetry")
