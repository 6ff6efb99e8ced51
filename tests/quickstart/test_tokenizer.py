"""The quick start tokenizer: offline AutoTokenizer folder, exact round trip, digits as tokens,
``<think>`` tags kept on decode, and the chat template; Magistral 1.2's ``[THINK]`` tags as single
special tokens, and the run's check that its tokenizer holds the recipe's tags."""

from __future__ import annotations

import pytest
import transformers

from megatron_rl.data.sampling import check_think_tags_in, completion_decoder, decode_completion
from megatron_rl.errors import UsageError
from megatron_rl.quickstart.sft import format_trace, sft_pairs
from megatron_rl.quickstart.tokenizer import (
    EOS,
    QUICKSTART_PROMPT,
    QUICKSTART_SYSTEM_PROMPT,
    prompt_ids,
    text_ids,
)
from megatron_rl.rewards.format import check_format
from megatron_rl.rewards.template import (
    DEFAULT_THINK_TAGS,
    MAGISTRAL_THINK_TAGS,
    MATH_INSTRUCTION,
    SYSTEM_PROMPT,
    fill_think_tags,
)


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


@pytest.fixture(scope="module")
def magistral_tokenizer(problems, tmp_path_factory):
    """The quick start's tokenizer as ``reward.think_tags: ["[THINK]", "[/THINK]"]`` builds it."""
    from megatron_rl.quickstart.tokenizer import build_tokenizer, load_tokenizer

    train, _ = problems
    corpus = [fill_think_tags(QUICKSTART_PROMPT, MAGISTRAL_THINK_TAGS), MATH_INSTRUCTION]
    corpus += [t for p in train for t in (p.problem, format_trace(p, think_tags=MAGISTRAL_THINK_TAGS))]
    folder = build_tokenizer(
        corpus, tmp_path_factory.mktemp("tok") / "magistral", think_tags=MAGISTRAL_THINK_TAGS
    )
    return load_tokenizer(folder)


def test_magistral_tags_are_single_special_tokens_the_run_reads_back(magistral_tokenizer, problems):
    """As Magistral 1.2's tokenizer holds them: one special token each, which the run's decode
    keeps (the format check reads them) and which a prompt's text encodes to."""
    tok, (train, _) = magistral_tokenizer, problems
    for p in train[:10]:
        trace = format_trace(p, think_tags=MAGISTRAL_THINK_TAGS)
        ids = text_ids(tok, trace)
        tokens = tok.convert_ids_to_tokens(ids)
        assert tokens[0] == "[THINK]" and tokens.count("[/THINK]") == 1
        assert all(t in tok.all_special_tokens for t in MAGISTRAL_THINK_TAGS)
        for text in (decode_completion(tok, ids + [tok.eos_token_id]), completion_decoder(tok)(ids)):
            assert text == trace  # every token kept, the table's decode and the tokenizer's alike
            parsed, why = check_format(text, "math", MAGISTRAL_THINK_TAGS)
            assert parsed is not None, why
    (prompt, answer), *_ = sft_pairs(tok, train[:1], think_tags=MAGISTRAL_THINK_TAGS)
    assert "Think inside [THINK] [/THINK], then answer." in tok.decode(prompt)
    assert answer[0] == tok.convert_tokens_to_ids("[THINK]")


def test_a_tokenizer_without_the_recipes_tags_is_refused_naming_the_field(tokenizer, magistral_tokenizer):
    check_think_tags_in(magistral_tokenizer, MAGISTRAL_THINK_TAGS)
    check_think_tags_in(tokenizer, DEFAULT_THINK_TAGS)
    check_think_tags_in(magistral_tokenizer, DEFAULT_THINK_TAGS)  # the default may be text, in pieces
    with pytest.raises(
        UsageError, match=r"reward\.think_tags: '\[THINK\]' is not one token of the tokenizer at tok/ "
    ):
        check_think_tags_in(tokenizer, MAGISTRAL_THINK_TAGS, name="tok/")
