"""A real byte-level BPE tokenizer with a ChatML chat template, trained here on English and
arithmetic text (nothing downloaded): its merges make a decode -> encode round trip of sampled
ids change them, which is what the multi-turn token tests need."""

from __future__ import annotations

import transformers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Keeps the thinking of the latest assistant turn only, as Qwen3's template does.
DROPS_THINKING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The answer is the sum of the two numbers. Let me compute it with the tool.",
    "What is 123 * 456? The product of these numbers is 56088, so the answer is 56088.",
    "Solve for x: 4x - 3 = 1. Then x = 1. The result of the program is printed below.",
    "print(123 * 456)\n```python\nprint(7 * 8)\n```\nResult: 56\n",
    "<think>I need to multiply the numbers, then check the result.</think> The answer is 42.",
] * 20


def chatml_tokenizer(template: str = CHATML) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<unk>"
    )
    fast.chat_template = template
    return fast
