"""A small BPE tokenizer trained here on the quick start's own texts, saved for transformers.

    folder = build_tokenizer(corpus_texts, "out/tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(folder)          # offline, no hub
    ids = prompt_ids(tok, "What is 3 + 4?")                            # chat-templated prompt

Design, for a model that must learn arithmetic in a few CPU minutes:

- **Digits are single tokens, always the same ten ids** (the pre-tokenizer isolates every digit
  and gives the space before a number to the preceding word or symbol: ``" = "``, ``"4"``,
  ``"8"`` for `` = 48``), so a number is spelled out digit by digit with one id per digit value
  and the arithmetic facts are learnable maps between those ids. Words, operators and punctuation
  merge freely (BPE), so the fixed phrases of the traces cost one token per word.
- **Byte-level alphabet restricted to printable ASCII and newline**: decoding is an exact inverse
  of encoding for every text of the quick start, and the vocabulary stays at a few hundred ids
  (a full 256-byte alphabet would add ids the model can only learn to avoid).
- ``<think>`` and ``</think>`` are single *added* tokens, not special ones: ``decode(...,
  skip_special_tokens=True)`` keeps them, because the reward's format check reads them. Other
  ``reward.think_tags`` (Magistral 1.2's ``[THINK]``/``[/THINK]``) are single *special* tokens,
  as in the tokenizer they come from (the run decodes completions with every token kept). The
  special tokens are ``<|pad|>``, ``<|end|>`` (EOS: ends every turn and every completion),
  ``<|unk|>`` and the role markers.
- **Chat template**: ``<|system|>...<|end|><|user|>...<|end|><|assistant|>``.

**System prompt.** The quick start uses :data:`QUICKSTART_SYSTEM_PROMPT`, one line, instead of the
paper's ~200-word prompt (:data:`megatron_rl.rewards.template.SYSTEM_PROMPT`). A fixed prompt
carries nothing the model can use: every sequence repeats it. With this tokenizer (trained on
the quick start's own texts, so the prompt's words are mostly spelled letter by letter) the
paper's prompt makes a prompt ~615 tokens long instead of ~34, for a completion of ~33: every
SFT step, every prefill and every RL step would cost about ten times as much on a 2-core CPU.
Real runs keep the paper's prompt (``build_messages`` defaults to it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from megatron_rl.data.sampling import render_prompt
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS, fill_think_tags

__all__ = [
    "CHAT_TEMPLATE",
    "EOS",
    "PAD",
    "QUICKSTART_PROMPT",
    "QUICKSTART_SYSTEM_PROMPT",
    "ROLE_TOKENS",
    "UNK",
    "build_tokenizer",
    "load_tokenizer",
    "prompt_ids",
    "text_ids",
]

QUICKSTART_PROMPT = (
    "Think inside {think_open} {think_close}, then answer."  # recipe.yaml's data.system_prompt
)
QUICKSTART_SYSTEM_PROMPT = fill_think_tags(QUICKSTART_PROMPT)  # with the default tags

PAD, EOS, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# GPT-2's split, changed so that a digit is always a token of its own and never carries a space:
# `` 48`` would otherwise start with a different id than ``48`` (``Ġ4`` vs ``4``), and the model
# would have to learn every arithmetic fact twice. A word or symbol run takes the one space that
# separates it from a following digit instead (``" = "``, ``"Add "``).
_SPLIT = r"\p{N}| ?\p{L}+(?: (?=\p{N}))?| ?[^\s\p{L}\p{N}]+(?: (?=\p{N}))?|\s+(?!\S)|\s+"
_ALPHABET = [chr(c) for c in range(32, 127)] + ["\n"]


def _byte_level_chars(chars: list[str]) -> list[str]:
    """The byte-level pre-tokenizer's spelling of each character (space -> ``Ġ``, ...)."""
    from tokenizers import pre_tokenizers  # lazy: only the quick start trains a tokenizer

    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [bl.pre_tokenize_str(c)[0][0] for c in chars]


def build_tokenizer(
    texts: Iterable[str],
    folder: str | os.PathLike,
    *,
    vocab_size: int = 320,
    think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS,
) -> Path:
    """Train the BPE on ``texts`` (prompts and traces), save it to ``folder`` with its
    ``tokenizer_config.json`` and chat template; return the folder. ``vocab_size`` is an upper
    bound: merges stop when every pre-token of the corpus is one token. ``think_tags``: one
    token each (added; special unless they are the default)."""
    from tokenizers import (  # lazy: only the quick start trains a tokenizer
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import (
        PreTrainedTokenizerFast,  # lazy: transformers takes seconds to import; only this path needs it
    )

    specials = [PAD, EOS, UNK, *ROLE_TOKENS]
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=_byte_level_chars(_ALPHABET),
        limit_alphabet=len(_ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    special = tuple(think_tags) != DEFAULT_THINK_TAGS
    tags = [AddedToken(t, special=special, normalized=False) for t in think_tags]
    if special:
        tok.add_special_tokens(tags)
    else:
        tok.add_tokens(tags)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[*ROLE_TOKENS, *(think_tags if special else ())],
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def load_tokenizer(folder: str | os.PathLike):
    """``AutoTokenizer`` from the folder, offline."""
    from transformers import (
        AutoTokenizer,  # lazy: transformers takes seconds to import; only this path needs it
    )

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added around it)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, problem: str, *, system_prompt: str = QUICKSTART_SYSTEM_PROMPT) -> list[int]:
    """Token ids of the chat-templated prompt for a math problem, ending with the assistant
    marker: :func:`megatron_rl.data.sampling.render_prompt`, the RL loop's own, so SFT trains
    on exactly the prompts RL and evaluation send."""

    return render_prompt(tokenizer, problem, "math", system_prompt=system_prompt)
