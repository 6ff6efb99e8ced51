"""Prompts through a tokenizer's chat template, or as plain text for a tokenizer without one
(``data.chat_template``): real tokenizer folders saved here, loaded as a run loads them."""

from __future__ import annotations

import json

import pytest
from jinja2 import TemplateError
from tokenizers import processors

from megatron_rl.config import ConfigError
from megatron_rl.data.sampling import load_tokenizer, render_prompt
from megatron_rl.orchestration.recipe import load_config
from megatron_rl.quickstart.tokenizer import CHAT_TEMPLATE as QUICKSTART_TEMPLATE
from megatron_rl.rewards.template import MATH_INSTRUCTION, SYSTEM_PROMPT, has_chat_template
from tests.data.tinylm import make_tokenizer

PROBLEM = "What is 2+2?"
USER = f"{PROBLEM}\n\n{MATH_INSTRUCTION}"
# Mistral-style: a system message is refused with raise_exception, as Mistral-7B-Instruct's and
# Gemma's templates do.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
)


def _folder(tmp_path, name: str, template: str | None, *, in_config: bool = False, bos: bool = False):
    """A character-level tokenizer saved to ``tmp_path/name`` with ``template`` (None: none);
    ``in_config``: the template inside tokenizer_config.json, as most published models have it,
    instead of chat_template.jinja; ``bos``: the tokenizer adds ``<s>`` as a Llama one does."""
    tok = make_tokenizer()
    tok.chat_template = template
    if bos:
        bos_id = tok.convert_tokens_to_ids("<s>")
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos_id)]
        )
    folder = tmp_path / name
    tok.save_pretrained(folder)
    if in_config:
        jinja = folder / "chat_template.jinja"
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = jinja.read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        jinja.unlink()
    return str(folder)


@pytest.mark.parametrize("in_config", [False, True])
def test_a_chat_template_renders_the_system_prompt_as_the_system_message(tmp_path, in_config):
    tok = load_tokenizer(_folder(tmp_path, "chat", QUICKSTART_TEMPLATE, in_config=in_config, bos=True))
    assert has_chat_template(tok)
    ids = render_prompt(tok, PROBLEM, "math", system_prompt="Be brief.")
    # The quick start's template, by hand: no BOS added on top of the template's text.
    expected = f"<|system|>Be brief.<|end|><|user|>{USER}<|end|><|assistant|>"
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == expected
    # The paper's prompt is the default; "" leaves the system message out.
    assert tok.decode(render_prompt(tok, PROBLEM, "math")).startswith(f"<|system|>{SYSTEM_PROMPT}<|end|>")
    assert tok.decode(render_prompt(tok, PROBLEM, "math", system_prompt="")) == (
        f"<|user|>{USER}<|end|><|assistant|>"
    )


def test_without_a_template_prompts_are_plain_text_with_the_tokenizers_bos(tmp_path):
    tok = load_tokenizer(_folder(tmp_path, "base", None, bos=True))
    assert not has_chat_template(tok)
    ids = render_prompt(tok, PROBLEM, "math", system_prompt="Be brief.")
    assert ids[0] == tok.convert_tokens_to_ids("<s>")
    assert tok.decode(ids) == f"<s>Be brief.\n\n{USER}\n\n"
    # Magistral's prompt ends with "Problem:": the problem follows it after one blank line.
    text = tok.decode(render_prompt(tok, PROBLEM, "code"), skip_special_tokens=True)
    assert "the user.\n\nProblem:\n\nWhat is 2+2?\n\nGive your solution" in text


def test_chat_template_none_ignores_the_folders_template(tmp_path):
    folder = _folder(tmp_path, "chat", QUICKSTART_TEMPLATE)
    assert has_chat_template(load_tokenizer(folder))
    tok = load_tokenizer(folder, chat_template="none")
    assert not has_chat_template(tok)
    assert tok.decode(render_prompt(tok, PROBLEM, "math", system_prompt="Be brief.")) == (
        f"Be brief.\n\n{USER}\n\n"
    )
    with pytest.raises(ValueError, match="chat_template: must be 'auto' or 'none'"):
        load_tokenizer(folder, chat_template="chatml")


def test_a_template_that_refuses_a_system_role_gets_it_in_the_user_message(tmp_path):
    tok = load_tokenizer(_folder(tmp_path, "mistral", NO_SYSTEM_TEMPLATE))
    ids = render_prompt(tok, PROBLEM, "math", system_prompt="Be brief.")
    assert tok.decode(ids) == f"<s>[INST] Be brief.\n\n{USER} [/INST]"
    # Without a system prompt nothing is merged, and a template error unrelated to the system
    # role is not hidden.
    assert tok.decode(render_prompt(tok, PROBLEM, "math", system_prompt="")) == f"<s>[INST] {USER} [/INST]"
    broken = load_tokenizer(_folder(tmp_path, "broken", "{{ raise_exception('bad template') }}"))
    with pytest.raises(TemplateError, match="bad template"):
        render_prompt(broken, PROBLEM, "math", system_prompt="")


def test_the_recipe_field_is_checked_at_load(tmp_path):
    assert load_config(None).data.chat_template == "auto"
    assert load_config(None, ["data.chat_template=none"]).data.chat_template == "none"
    with pytest.raises(ConfigError, match=r"data.chat_template: must be one of \['auto', 'none'\]"):
        load_config(None, ["data.chat_template=chatml"])
