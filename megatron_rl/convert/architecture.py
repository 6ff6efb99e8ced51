"""Which model a config.json describes: the ``transformers`` config object built from its dict, and
the architecture two configs must share to describe the same weights.

:func:`check_same_architecture` compares the values that shape the weights or the computation
(effective values filled in: head_dim, kv heads, RoPE parameters in either layout, MoE and MLA
settings, a vision tower's config) and ignores the fields that change neither (token ids,
``max_position_embeddings``, ``use_cache``, dtype, ...). An export checks the config it is given
against the one the weights were converted with (:mod:`megatron_rl.convert.to_hf`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from megatron_rl.hf.arch import language_model_config, mla_settings, moe_settings, rope_parameters
from megatron_rl.hf.layout import WeightsMismatchError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from megatron_rl.fileio import JsonValue

__all__ = ["check_same_architecture", "config_from_dict"]


def config_from_dict(config: dict[str, JsonValue]) -> PretrainedConfig:
    """A ``transformers`` config object from a config.json dict (ValueError naming the field
    for a model type transformers does not know, or a config its validators refuse)."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,  # lazy: transformers takes seconds to import; only this path needs it
    )

    if config.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"model_type: {config.get('model_type')!r} is not a transformers model")
    try:
        return CONFIG_MAPPING[config["model_type"]].from_dict(config)
    except Exception as e:  # noqa: BLE001 -- transformers' validators raise their own types (huggingface_hub's)
        raise ValueError(f"transformers refuses this {config['model_type']} config: {e}") from None


def _architecture(config: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """The config values that shape the weights or the computation, effective values filled in
    (head_dim, kv heads, RoPE parameters in either layout). Not compared: fields that change
    neither (token ids, max_position_embeddings, use_cache, dtype, ...)."""
    whole = config_from_dict(config)
    hf = language_model_config(whole)
    heads = hf.num_attention_heads
    window = getattr(hf, "sliding_window", None)
    if hf.model_type.startswith("qwen") and not getattr(hf, "use_sliding_window", False):
        window = None
    arch: dict[str, JsonValue] = {
        "model_type": whole.model_type,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "vocab_size": hf.vocab_size,
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "rms_norm_eps": hf.rms_norm_eps,
        "hidden_act": getattr(hf, "hidden_act", "silu"),
        "attention_bias": bool(getattr(hf, "attention_bias", False)),
        "mlp_bias": bool(getattr(hf, "mlp_bias", False)),
        "sliding_window": window,
    }
    moe = moe_settings(hf)
    if moe is not None:
        arch.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.ffn,
            norm_topk_prob=moe.norm_topk_prob,
            scoring_func=moe.score_function,
            n_shared_experts=moe.shared_ffn // moe.ffn,
            first_k_dense_replace=moe.first_dense,
            n_group=moe.num_groups,
            topk_group=moe.group_topk,
            routed_scaling_factor=moe.scaling_factor,
        )
    mla = mla_settings(hf)
    if mla is not None:
        arch.update(
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope,
            qk_rope_head_dim=mla.qk_rope,
            v_head_dim=mla.v_dim,
        )
    vision = getattr(whole, "vision_config", None)
    if vision is not None:  # the carried tensors' shapes: one canonical string, compared whole
        arch["vision_config"] = json.dumps(vision.to_diff_dict(), sort_keys=True)
    rope = rope_parameters(hf)  # the same reading the model builder uses
    arch["rope_theta"] = rope.pop("rope_theta")
    arch.update({f"rope_parameters.{k}": v for k, v in sorted(rope.items()) if k != "type"})
    return arch


def check_same_architecture(stored: dict[str, JsonValue], given: dict[str, JsonValue]) -> None:
    """Raise WeightsMismatchError naming the first field where config.json dict ``given``
    describes another model than ``stored`` (the one the weights were converted with)."""
    a, b = _architecture(stored), _architecture(given)
    for field in sorted(a.keys() | b.keys(), key=lambda k: (k not in a, k)):
        if a.get(field) != b.get(field):
            raise WeightsMismatchError(
                field,
                f"the checkpoint was converted with {field}={a.get(field)!r}, the given "
                f"config has {b.get(field)!r}",
            )
