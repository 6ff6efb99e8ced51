import json

import pytest

from megatron_rl.config import ConfigError, ConfigFieldError
from megatron_rl.orchestration.recipe import load_config
from megatron_rl.rewards.compose import RewardConfig, RewardInput, score
from megatron_rl.rewards.format import check_format, last_boxed
from megatron_rl.rewards.template import (
    MAGISTRAL_THINK_TAGS,
    SYSTEM_PROMPT,
    build_messages,
    fill_think_tags,
    system_prompt,
)


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


@pytest.mark.parametrize(
    "completion, ok, why",
    [
        ("[THINK]hmm[/THINK]The answer is $\\boxed{2}$.", True, ""),
        ("<think>hmm</think>The answer is $\\boxed{2}$.", False, "does not start with [THINK]"),
        ("[THINK]a[/THINK]b[/THINK]\\boxed{2}", False, "exactly one [THINK] and one [/THINK]"),
        ("[THINK]a <think>b</think>[/THINK]\\boxed{2}", True, ""),  # other tags are text
    ],
)
def test_the_format_follows_the_recipes_think_tags(completion, ok, why):
    parsed, reason = check_format(completion, "math", MAGISTRAL_THINK_TAGS)
    assert (parsed is not None) == ok and why in reason
    if ok:
        assert parsed.thinking.startswith(("hmm", "a")) and "[/THINK]" not in parsed.answer
    rewarded = score(RewardInput(problem="1+1?", completion=completion, task="math", answer="2"), CFG)
    assert rewarded.format_ok == ok and rewarded.correct == ok


CFG = RewardConfig(think_tags=list(MAGISTRAL_THINK_TAGS), language_reward=0.0, workers=1)


def test_the_system_prompt_names_the_runs_tags():
    prompt = system_prompt(MAGISTRAL_THINK_TAGS)
    assert "\n[THINK]\n" in prompt and "\n[/THINK]\n" in prompt and "<think>" not in prompt
    assert prompt.replace("[THINK]", "<think>").replace("[/THINK]", "</think>") == SYSTEM_PROMPT
    assert fill_think_tags("Think in {think_open} {think_close}: \\boxed{}", MAGISTRAL_THINK_TAGS) == (
        "Think in [THINK] [/THINK]: \\boxed{}"
    )


@pytest.mark.parametrize(
    "tags, why",
    [
        (["[THINK]"], "must be two strings"),
        ("[THINK]", "must be two strings"),
        (["[THINK]", 3], "must be two strings"),
        (["", "[/THINK]"], "non-empty"),
        ([" [THINK]", "[/THINK]"], "white space"),
        (["<t>", "<t>"], "neither tag may hold the other"),
        (["think", "/think"], "neither tag may hold the other"),
    ],
)
def test_bad_think_tags_are_a_config_error_naming_the_field(tags, why, tmp_path):
    with pytest.raises(ConfigFieldError, match=f"think_tags: .*{why}"):
        RewardConfig(think_tags=tags)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"reward:\n  think_tags: {json.dumps(tags)}\n")
    with pytest.raises(
        ConfigError, match=r"r\.yaml:2: reward\.think_tags: "
    ):  # the loader's type check, or ours
        load_config(str(recipe), [])


def test_the_tags_come_from_the_recipe_or_an_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reward:\n  l_max: 64\n  l_cache: 16\n")
    assert load_config(str(recipe), []).reward.think_tags == ["<think>", "</think>"]
    cfg = load_config(str(recipe), ['reward.think_tags=["[THINK]", "[/THINK]"]'])
    assert cfg.reward.think_tags == ["[THINK]", "[/THINK]"]
