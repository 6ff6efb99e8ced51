"""A tiny character-level tokenizer with a chat template, and tiny Llama (or Qwen3, Qwen3-MoE, Mixtral)
models saved with ``save_pretrained`` (nothing downloaded), for the curation, evaluation and
end-to-end training tests.

:func:`answering_model` sets a one-layer model's weights by hand so that it is a *bigram* model
that writes ``<think>hm</think>\\boxed{4}`` (probability ``p_four``) or ``...\\boxed{5}`` after the
generation prompt, then EOS: the attention and MLP outputs are zero (``o_proj``, ``down_proj``),
the embedding is a scaled one-hot code, so the last hidden state is the current token's code and
``lm_head`` is a transition table (in every family: Qwen3's q/k norms act inside attention, whose
output projection is zero, and each Qwen3-MoE expert's ``down_proj`` is zero). It runs through the real engine, chat template and verifiers
like any checkpoint, and gets a known share of answers right.
"""

from __future__ import annotations

import math
import string
import sys
from pathlib import Path

import torch
import transformers

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
THINK = ["<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(folder: str | Path | None = None) -> transformers.PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus specials and ``<think>``/``</think>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.add_tokens(THINK)  # not special: they stay in decoded text
    fast.chat_template = CHAT_TEMPLATE
    if folder is not None:
        fast.save_pretrained(folder)
    return fast


#: family -> (config class, what it adds to the shared tiny shape)
FAMILIES: dict[str, tuple[type[transformers.PretrainedConfig], dict]] = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True
        ),
    ),
    "mixtral": (transformers.MixtralConfig, dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "mistral": (transformers.MistralConfig, dict(head_dim=16, sliding_window=None)),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            num_hidden_layers=2,  # a dense first layer, then an MoE layer
            first_k_dense_replace=1,
            num_key_value_heads=2,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
    ),
}


def mistral3_config(text: transformers.MistralConfig, **overrides) -> transformers.Mistral3Config:
    """A Mistral3 (vision-language) config around the language model ``text``, with a tiny Pixtral
    vision tower (one layer, 16 wide) and its projector; untied as Mistral Small 3.x is, unless
    ``overrides`` say otherwise."""
    vision = transformers.PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=32,
        patch_size=8,
    )
    kwargs = dict(image_token_index=10, spatial_merge_size=2, tie_word_embeddings=text.tie_word_embeddings)
    return transformers.Mistral3Config(text_config=text, vision_config=vision, **(kwargs | overrides))


def build_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """A random model of ``config``: a causal LM, or Mistral3's vision-language class."""
    if config.model_type == "mistral3":
        return transformers.Mistral3ForConditionalGeneration(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def _config(vocab: int, hidden: int, eos: int, family: str = "llama") -> transformers.PretrainedConfig:
    if family == "mistral3":
        return mistral3_config(_config(vocab, hidden, eos, "mistral"))
    cls, extra = FAMILIES[family]
    base = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return cls(**{**base, **extra})


def random_model(
    folder: str | Path, seed: int = 0, family: str = "llama"
) -> transformers.PreTrainedTokenizerFast:
    """A random one-layer model of ``family`` and the tokenizer, both saved in ``folder``."""
    tok = make_tokenizer()
    torch.manual_seed(seed)
    model = build_model(_config(len(tok), 64, tok.eos_token_id, family))
    model.float().save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def answering_model(
    folder: str | Path, p_four: float = 0.75, logit: float = 30.0, family: str = "llama"
) -> transformers.PreTrainedTokenizerFast:
    """The bigram model of the module docstring (one layer of ``family``) and its tokenizer,
    saved in ``folder``."""
    tok = make_tokenizer()
    vocab = len(tok)
    hidden = 1 << (vocab - 1).bit_length()  # >= vocab: room for a one-hot code per token
    model = build_model(_config(vocab, hidden, tok.eos_token_id, family))
    ids = tok.convert_tokens_to_ids
    chain = ["<|assistant|>", "<think>", "h", "m", "</think>", "\\", "b", "o", "x", "e", "d", "{"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (transformers 5 holds a MoE layer's experts as one 3-D ``experts.down_proj``)
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()  # the layer adds nothing: the last hidden state is the token's embedding
        emb = model.get_input_embeddings().weight
        emb.zero_()
        emb[:, :vocab] = torch.eye(vocab)
        # RMSNorm maps a one-hot row to sqrt(hidden) * one-hot; scale the table to undo it.
        head = model.get_output_embeddings().weight
        head.zero_()
        scale = logit / math.sqrt(hidden)
        for cur, nxt in zip(chain, chain[1:]):
            head[ids(nxt), ids(cur)] = scale
        head[ids("4"), ids("{")] = scale
        head[ids("5"), ids("{")] = scale + math.log((1 - p_four) / p_four) / math.sqrt(hidden)
        for digit in "45":
            head[ids("}"), ids(digit)] = scale
        head[tok.eos_token_id, ids("}")] = scale
    model.float().save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def tiny_train_command(model: Path, run: Path, steps: int, *overrides: str) -> list[str]:
    """``megatron-rl train`` of the quick-start recipe on ``model`` for ``steps`` steps with
    :data:`TINY_LOOP` and ``overrides``, as the tests that train end to end run it."""
    recipe = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    return [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        str(recipe),
        "--no-progress",
        f"model.hf={model}",
        f"run.dir={run}",
        f"loop.max_steps={steps}",
        *TINY_LOOP,
        *overrides,
    ]


# The smallest loop the quick start's own end-to-end test runs, as recipe overrides: the tests
# that train a tiny model end to end (your data, your reward) start from these.
TINY_LOOP = [
    "loop.n_batch=16",
    "loop.n_async=32",
    "loop.group_size=4",
    "reward.l_max=48",
    "reward.l_cache=16",
    "fleet.max_slots=16",
]
