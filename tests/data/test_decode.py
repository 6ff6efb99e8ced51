"""The completion decoder the RL loop runs on every completion: its byte-level table reads exactly
what the tokenizer's own decode does (special tokens, multi-byte characters, a character cut
between tokens, ids past the vocabulary), and any other tokenizer keeps its own decode."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_rl.data.sampling import byte_level_table, completion_decoder, decode_completion

CORPUS = [
    "<think> 2 + 2 = 4, donc la réponse est 4 </think> The answer is \\boxed{4}.",
    "数学：∑ᵢ xᵢ² ≥ 0 — naïve café, Ünïcödé 🙂 and tabs\tand\nnewlines",
    "def f(x):\n    return x ** 2  # ½ of ∞",
] * 20


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|end|>", AddedToken("<|a b|>", special=True)],  # one with a space
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return _fast(tok)


def _reference(tok: PreTrainedTokenizerFast, ids: list[int]) -> str:
    if ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False)


def test_the_byte_level_table_decodes_as_the_tokenizer_does(byte_level):
    assert byte_level_table(byte_level._tokenizer) is not None
    decode = completion_decoder(byte_level)
    size = len(byte_level)
    rng = random.Random(1)
    cases = [byte_level.encode(text) for text in CORPUS[:3]]
    cases += [ids[:cut] for ids in cases for cut in range(1, len(ids))]  # characters cut between tokens
    cases += [[rng.randrange(size) for _ in range(rng.randrange(1, 60))] for _ in range(500)]
    cases += [ids + [byte_level.eos_token_id] for ids in cases[:50]]  # a final EOS is not text
    cases += [[], [byte_level.convert_tokens_to_ids("<|a b|>"), 7]]
    for ids in cases:
        assert decode(ids) == _reference(byte_level, ids) == decode_completion(byte_level, ids), ids


@pytest.mark.fault("input")
def test_ids_outside_the_vocabulary_get_the_tokenizers_own_answer(byte_level):
    decode = completion_decoder(byte_level)
    past = [5, len(byte_level) + 10, 6]
    assert decode(past) == byte_level._tokenizer.decode(past, skip_special_tokens=False)
    with pytest.raises(OverflowError):  # what the Rust decoder raises; no wrong text from the table
        byte_level._tokenizer.decode([5, -1], skip_special_tokens=False)
    with pytest.raises(OverflowError):
        decode([5, -1])


def test_a_tokenizer_that_is_not_byte_level_keeps_its_own_decode():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|end|>"]))
    fast = _fast(tok)
    assert byte_level_table(tok) is None
    decode = completion_decoder(fast)
    for text in CORPUS[:3]:
        ids = fast.encode(text)
        assert decode(ids) == _reference(fast, ids)
