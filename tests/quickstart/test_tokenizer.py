"""The quick start tokenizer: offline AutoTokenizer folder, exact round trip, digits as tokens,
``<think>`` tags kept on decode, and the chat template."""

from __future__ import annotations

import transformers

from megatron_rl.quickstart.sft import format_trace
from megatron_rl.quickstart.tokenizer import EOS, QUICKSTART_SYSTEM_PROMPT, prompt_ids, text_ids
from megatron_rl.rewards.template import MATH_INSTRUCTION, SYSTEM_PROMPT


def test_folder_loads_offline_with_auto_tokenizer(tokenizer_dir):
    assert (tokenizer_dir / "tokenizer.json").is_file()
    assert (tokenizer_dir / "tokenizer_config.json").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert tok.eos_token == EOS and tok.pad_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert 100 < len(tok) < 400  # a few hundred ids: printable ASCII plus merges


def test_trace_round_trips_and_digits_are_bare_single_tokens(tokenizer, problems):
    train, held_out = problems
    for p in train[:20] + held_out[:20]:
        trace = format_trace(p)
        ids = text_ids(tokenizer, trace)
        assert tokenizer.decode(ids) == trace
        # EOS is special: dropped on decode, as the generator's completions are read
        assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == trace
        for token in tokenizer.convert_ids_to_tokens(ids):
            # a digit is a token of its own, without a space: ten ids spell every number
            assert not any(c.isdigit() for c in token) or token in set("0123456789"), token


def test_think_tags_are_single_tokens_kept_on_decode(tokenizer):
    ids = text_ids(tokenizer, "<think>So 2 + 2 = 4.</think>The answer is \\boxed{4}.")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == "<think>" and "</think>" in tokens
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("<think>So")


def test_chat_template(tokenizer):
    text = (
        f"<|system|>{QUICKSTART_SYSTEM_PROMPT}<|end|>"
        f"<|user|>What is 3 + 4?\n\n{MATH_INSTRUCTION}<|end|><|assistant|>"
    )
    ids = prompt_ids(tokenizer, "What is 3 + 4?")
    assert tokenizer.decode(ids) == text
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert ids.count(tokenizer.eos_token_id) == 2  # ends the system and the user turn
    # The one-line system prompt is the point: the paper's is an order of magnitude longer.
    assert len(ids) < 45
    assert len(prompt_ids(tokenizer, "What is 3 + 4?", system_prompt=SYSTEM_PROMPT)) > 8 * len(ids)
