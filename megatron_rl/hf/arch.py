"""What an HF config says about an architecture, for every part that needs it: the families we
support (and which have q/k norms or experts), the MoE settings, the HF config itself
(``config.json`` read locally, never from a hub), the language model of a vision-language
family, RoPE settings in either transformers layout, and the vocabulary padding that keeps
checkpoint shapes TP-independent.

Layer 2 (pure parts): imports only the layers below it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from megatron_rl.fileio import JsonValue

__all__ = [
    "CARRIED_PREFIXES",
    "MLA_MODEL_TYPES",
    "MOE_MODEL_TYPES",
    "QK_NORM_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "TEXT_PREFIXES",
    "VOCAB_DIVISIBLE_BY",
    "HFConfigLike",
    "MLASettings",
    "MoESettings",
    "YarnSettings",
    "language_model_config",
    "language_model_dict",
    "load_hf_config",
    "mla_settings",
    "moe_settings",
    "padded_vocab_size",
    "rope_parameters",
    "routed_shape",
    "yarn_settings",
]

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "mistral3",
    "deepseek_v3",
)
#: Families with an RMSNorm over each query / key head before RoPE (``q_norm``, ``k_norm``).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
#: Families whose MLPs are mixtures of experts (softmax router, top-k, no shared expert; DeepSeek-V3:
#: sigmoid router with an expert bias, shared experts, leading dense layers).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")
#: Families with multi-latent attention (low-rank q and kv projections, a shared RoPE key).
MLA_MODEL_TYPES = ("deepseek_v3",)

#: Vision-language families -> the prefix of their language model's tensors in the HF files
#: (``language_model.model.layers.0...``, ``language_model.lm_head.weight``: the names
#: transformers writes and SGLang's loader reads). The language model is what is trained; its
#: config is ``text_config`` (:func:`language_model_config`).
TEXT_PREFIXES = {"mistral3": "language_model."}
#: Vision-language families -> the prefixes of the tensors carried through untouched (the
#: vision tower and the projector: never trained, kept bit for bit, written back on export).
CARRIED_PREFIXES = {"mistral3": ("vision_tower.", "multi_modal_projector.")}
#: The language-model families a vision-language family may wrap.
_TEXT_MODEL_TYPES = {"mistral3": ("mistral",)}

# Megatron pads the vocabulary so each TP shard is a multiple of 128 (GEMM-friendly) ids.
VOCAB_DIVISIBLE_BY = 128

#: What :func:`load_hf_config` accepts: a loaded config, or the HF folder holding its config.json.
HFConfigLike: TypeAlias = "PretrainedConfig | str | os.PathLike[str]"


def language_model_dict(config: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
    """The language model's part of a config.json dict: ``text_config`` for a vision-language
    family (with the top-level ``tie_word_embeddings``, which is what transformers ties by, and
    whose default for Mistral3 is true), else the dict itself. Raises ValueError naming the
    field when a vision-language config has no usable ``text_config``."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in TEXT_PREFIXES:
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(
            f"text_config: a {model_type} config needs its language model's config, got {text!r}"
        )
    _check_text_type(model_type, text.get("model_type"))
    return {**text, "tie_word_embeddings": bool(config.get("tie_word_embeddings", True))}


def _check_text_type(model_type: str, text_type: JsonValue) -> None:
    if text_type not in _TEXT_MODEL_TYPES[model_type]:
        raise ValueError(
            f"text_config.model_type: {model_type}'s language model must be one of "
            f"{', '.join(_TEXT_MODEL_TYPES[model_type])}, got {text_type!r}"
        )


def language_model_config(hf: PretrainedConfig) -> PretrainedConfig:
    """The config of the language model ``hf`` describes: ``hf`` itself, or for a vision-language
    family a copy of its text config tied as the whole model is (see :func:`language_model_dict`)."""
    if hf.model_type not in TEXT_PREFIXES:
        return hf
    import copy  # lazy: only vision-language configs need a copy

    _check_text_type(hf.model_type, hf.get_text_config().model_type)
    text = copy.deepcopy(hf.get_text_config())
    text.tie_word_embeddings = bool(hf.tie_word_embeddings)
    return text


def load_hf_config(hf_config: HFConfigLike) -> PretrainedConfig:
    """``hf_config`` itself if it is a ``transformers.PretrainedConfig``; else read the
    ``config.json`` of the folder it names (no network access)."""
    import transformers  # lazy: transformers takes seconds to import; only this path needs it

    if isinstance(hf_config, transformers.PretrainedConfig):
        return hf_config
    if isinstance(hf_config, (str, os.PathLike)):
        folder = Path(hf_config)
        if not (folder / "config.json").is_file():
            raise ValueError(f"hf_config: {folder} is not a folder with a config.json")
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    raise TypeError(
        f"hf_config: expected a transformers.PretrainedConfig or a folder path, "
        f"got {type(hf_config).__name__}"
    )


@dataclass(frozen=True)
class MoESettings:
    """The mixture-of-experts part of an HF config (Qwen3-MoE's or Mixtral's fields)."""

    num_experts: int  # experts per MoE layer
    top_k: int  # num_experts_per_tok: experts each token is sent to
    ffn: int  # SwiGLU inner width of one expert
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    #: the config field that gives ``ffn``: Qwen3-MoE's moe_intermediate_size, Mixtral's
    #: intermediate_size (its experts are its MLPs)
    ffn_field: str = "moe_intermediate_size"
    # DeepSeek-V3's router and layout (the defaults: a softmax router over routed experts only)
    score_function: str = "softmax"  # "sigmoid": each expert scored on its own
    expert_bias: bool = False  # e_score_correction_bias: added to the scores for the choice only
    shared_ffn: int = 0  # width of the shared experts every token goes through (0: none)
    first_dense: int = 0  # first_k_dense_replace: leading layers with a dense MLP
    num_groups: int | None = None  # n_group > 1: experts in groups, top groups chosen first
    group_topk: int | None = None  # topk_group: groups chosen per token
    scaling_factor: float | None = None  # routed_scaling_factor: multiplies the routed weights

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (from 0) has experts (the leading ones may be dense)."""
        return layer >= self.first_dense


@dataclass(frozen=True)
class MLASettings:
    """DeepSeek's multi-latent attention: queries through a rank-``q_lora_rank`` bottleneck
    (None: one projection), keys and values from a rank-``kv_lora_rank`` latent, each head's key
    ``qk_nope`` wide plus a ``qk_rope`` wide RoPE part shared by all heads, values ``v_dim`` wide."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int  # qk_nope_head_dim
    qk_rope: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim


def _reader(hf: PretrainedConfig | Mapping[str, JsonValue]) -> Callable[..., JsonValue]:
    """``get(name, default=None)``: a field of a config object or of a config.json dict."""

    def get(name: str, default: JsonValue = None) -> JsonValue:
        if isinstance(hf, Mapping):
            return hf.get(name, default)
        return getattr(hf, name, default)

    return get


def mla_settings(hf: PretrainedConfig | Mapping[str, JsonValue]) -> MLASettings | None:
    """The multi-latent attention of a config (object or config.json dict), or None for the
    families with grouped-query attention. ValueError naming the field for what is not built:
    RoPE on the key/query dimensions in their original (non-interleaved) order."""

    get = _reader(hf)

    if get("model_type") not in MLA_MODEL_TYPES:
        return None
    if get("rope_interleave", True) is not True:
        raise ValueError("rope_interleave: only true (DeepSeek's released layout) is supported")
    values = {n: get(n) for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    q_lora = get("q_lora_rank")
    for name, value in {**values, "q_lora_rank": 1 if q_lora is None else q_lora}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    kv, nope, rope, v = (cast(int, x) for x in values.values())
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(
            f"num_key_value_heads: multi-latent attention gives every head its own key and value; "
            f"must equal num_attention_heads={heads}, got {kv_heads}"
        )
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim: must be even (RoPE rotates pairs), got {rope}")
    return MLASettings(
        q_lora_rank=cast("int | None", q_lora), kv_lora_rank=kv, qk_nope=nope, qk_rope=rope, v_dim=v
    )


def moe_settings(hf: PretrainedConfig | Mapping[str, JsonValue]) -> MoESettings | None:
    """The MoE settings of an HF config (object or config.json dict), or None for a dense family.

    Every layer must be an MoE layer (``decoder_sparse_step`` 1, ``mlp_only_layers`` empty, as in
    the released Qwen3-MoE models): dense layers mixed in are refused, naming the field. Mixtral
    always renormalises its top-k probabilities (its router is a softmax over the chosen experts'
    logits) and takes each expert's width from ``intermediate_size``; its training-time router
    jitter is refused (an RL trainer that perturbs routing would train experts the generators did
    not use).
    """

    get = _reader(hf)

    model_type = get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "deepseek_v3":
        return _deepseek_moe(get)
    if model_type == "mixtral":
        jitter = get("router_jitter_noise", 0.0) or 0.0
        if jitter != 0:
            raise ValueError(f"router_jitter_noise: only 0 (no routing noise) is supported, got {jitter!r}")
        return _checked_moe(
            {
                "num_local_experts": get("num_local_experts"),
                "num_experts_per_tok": get("num_experts_per_tok"),
                "intermediate_size": get("intermediate_size"),
            },
            norm_topk_prob=True,
        )
    if get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"decoder_sparse_step: only 1 (every layer an MoE layer) is supported, got {get('decoder_sparse_step')}"
        )
    if get("mlp_only_layers") or []:
        raise ValueError(
            f"mlp_only_layers: dense layers among the MoE layers are not supported, got {get('mlp_only_layers')}"
        )
    if get("shared_expert_intermediate_size") or 0:
        raise ValueError("shared_expert_intermediate_size: shared experts are not supported")
    values = {n: get(n) for n in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    if values["num_experts"] is None:  # transformers >= 5 writes num_experts as num_local_experts
        values["num_experts"] = get("num_local_experts")
    return _checked_moe(values, norm_topk_prob=bool(get("norm_topk_prob", False)))


def _deepseek_moe(get: Callable[..., JsonValue]) -> MoESettings:
    """DeepSeek-V3's MoE fields (``get(name, default)`` reads the config), checked against what
    Megatron-Core's sigmoid router computes: the top-k weights renormalised, groups scored by the
    sum of their two best experts."""
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if get(name, want) != want:
            raise ValueError(f"{name}: only {want!r} (DeepSeek-V3's router) is supported, got {get(name)!r}")
    base = _checked_moe(
        {
            "n_routed_experts": get("n_routed_experts"),
            "num_experts_per_tok": get("num_experts_per_tok"),
            "moe_intermediate_size": get("moe_intermediate_size"),
        },
        norm_topk_prob=bool(get("norm_topk_prob", True)),
    )
    if base.top_k > 1 and not base.norm_topk_prob:
        raise ValueError("norm_topk_prob: only true is supported (Megatron renormalises a sigmoid top-k)")
    ints = {
        "n_shared_experts": get("n_shared_experts", 0) or 0,
        "first_k_dense_replace": get("first_k_dense_replace", 0) or 0,
        "n_group": get("n_group", 1) or 1,
        "topk_group": get("topk_group", 1) or 1,
        "moe_layer_freq": get("moe_layer_freq", 1),
    }
    for name, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
    shared, first_dense, groups, group_topk, freq = (cast(int, v) for v in ints.values())
    if freq != 1:
        raise ValueError(
            f"moe_layer_freq: only 1 (every layer after the dense ones) is supported, got {freq}"
        )
    layers = get("num_hidden_layers")
    if isinstance(layers, int) and first_dense > layers:
        raise ValueError(f"first_k_dense_replace: {first_dense} is more than num_hidden_layers={layers}")
    if groups > 1:
        if base.num_experts % groups or not 1 <= group_topk <= groups:
            raise ValueError(
                f"n_group / topk_group: {groups} groups of the {base.num_experts} experts, {group_topk} "
                "chosen: the groups must divide the experts and at least one be chosen"
            )
        if base.top_k // group_topk != 2 or base.top_k % group_topk:
            raise ValueError(
                f"topk_group: a group is scored by its two best experts (DeepSeek-V3), which Megatron "
                f"does when num_experts_per_tok / topk_group = 2; got {base.top_k} / {group_topk}"
            )
    scale = get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"routed_scaling_factor: must be a number > 0, got {scale!r}")
    return MoESettings(
        num_experts=base.num_experts,
        top_k=base.top_k,
        ffn=base.ffn,
        norm_topk_prob=base.norm_topk_prob,
        score_function="sigmoid",
        expert_bias=True,
        shared_ffn=shared * base.ffn,
        first_dense=first_dense,
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=float(scale),
    )


def _checked_moe(values: dict[str, JsonValue], *, norm_topk_prob: bool) -> MoESettings:
    """``values``: (experts, top-k, expert width) under their config field names, in that order."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    experts_field, _, ffn_field = values
    experts, top_k, ffn = (cast(int, v) for v in values.values())
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok: {top_k} is more than {experts_field}={experts}")
    return MoESettings(
        num_experts=experts, top_k=top_k, ffn=ffn, norm_topk_prob=norm_topk_prob, ffn_field=ffn_field
    )


def routed_shape(hf_config: HFConfigLike) -> tuple[int, int]:
    """``(layers, top_k)`` of a model's routed experts (what routing replay records for every
    position; every layer, as SGLang reports them: DeepSeek-V3's leading dense layers hold zeros);
    ValueError naming ``algorithm.routing_replay`` for a model without experts."""
    whole = load_hf_config(hf_config)
    hf = language_model_config(whole)
    moe = moe_settings(hf)
    if moe is None:
        raise ValueError(
            f"algorithm.routing_replay: rollout replays an MoE model's routing; {whole.model_type!r} "
            "has no experts (use off)"
        )
    return int(hf.num_hidden_layers), moe.top_k


def padded_vocab_size(
    vocab_size: int, tensor_parallel: int, *, divisible_by: int = VOCAB_DIVISIBLE_BY, resume_tp: int = 8
) -> int:
    """Smallest multiple of ``divisible_by * lcm(tensor_parallel, resume_tp)`` >= ``vocab_size``.

    Megatron pads to ``divisible_by * tp``, which makes the padded size -- and so the embedding and
    output shapes in a checkpoint -- depend on TP: a run could not resume at another TP. Padding
    for every TP that divides ``resume_tp`` (1, 2, 4, 8 by default) keeps one shape for all of them.
    The extra rows are never produced by the tokenizer; their logits must be masked to -inf by
    whoever samples or computes log-probs.
    """
    if vocab_size < 1 or tensor_parallel < 1:
        raise ValueError(f"vocab_size and tensor_parallel must be >= 1, got {vocab_size}, {tensor_parallel}")
    multiple = divisible_by * math.lcm(tensor_parallel, resume_tp)
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class YarnSettings:
    """YaRN RoPE scaling as DeepSeek's configs give it (transformers' field names)."""

    factor: float  # how far the context is stretched (max_position / original when unset)
    original_max_position_embeddings: float
    beta_fast: float
    beta_slow: float
    mscale: float  # 0: unset
    mscale_all_dim: float  # 0: unset (DeepSeek sets both: the softmax scale then changes too)
    attention_factor: float | None  # an explicit factor for the rotary tables, or None
    truncate: bool  # round the correction range to whole dimensions (transformers' default)


def yarn_settings(rope: Mapping[str, JsonValue], max_position_embeddings: JsonValue) -> YarnSettings:
    """The YaRN fields of RoPE settings (``rope_parameters`` / ``rope_scaling``), checked: a
    ValueError naming the field for one that is not a positive number. Defaults as transformers':
    ``factor`` from ``max_position_embeddings / original_max_position_embeddings``, betas 32 / 1."""

    def number(name: str, value: JsonValue, *, zero: bool = False) -> float:
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or value < 0
            or (value == 0 and not zero)
        ):
            raise ValueError(f"rope_parameters.{name}: must be a number > 0 for YaRN, got {value!r}")
        return float(value)

    original = number("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
    factor = rope.get("factor")
    if factor is None:
        factor = number("max_position_embeddings", max_position_embeddings) / original
    attention = rope.get("attention_factor")
    return YarnSettings(
        factor=number("factor", factor),
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast", rope.get("beta_fast") or 32),
        beta_slow=number("beta_slow", rope.get("beta_slow") or 1),
        mscale=number("mscale", rope.get("mscale") or 0, zero=True),
        mscale_all_dim=number("mscale_all_dim", rope.get("mscale_all_dim") or 0, zero=True),
        attention_factor=None if attention is None else number("attention_factor", attention),
        truncate=bool(rope.get("truncate", True)),
    )


def rope_parameters(hf: PretrainedConfig) -> dict[str, JsonValue]:
    """RoPE settings in either layout: transformers >= 5 (``rope_parameters`` holding
    ``rope_theta``) or older config.json files (top-level ``rope_theta``, ``rope_scaling``).
    The values are config.json's (floats, ints and strings by RoPE type)."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope_parameters: per-layer-type RoPE settings {sorted(params)} are not supported")
    params = dict(params)
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params
