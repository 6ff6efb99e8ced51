"""A Megatron-Core ``GPTModel`` from a Hugging Face config (Mistral / Llama / Qwen2 / Qwen3 /
Qwen3-MoE, Mixtral families).

Shapes, as Megatron uses them: the model takes ``input_ids [b, s]`` and ``position_ids [b, s]``
(and ``attention_mask=None`` for plain causal attention) and, on the last pipeline stage, returns
vocab-parallel logits ``[b, s, padded_vocab / tp]`` (or the loss when given ``labels``). Rank ``r``
of the TP group holds vocabulary ids ``[r * V/tp, (r + 1) * V/tp)``, ``V`` the padded size. Earlier
stages return the hidden states ``[s, b, h]`` that the pipeline schedule sends on.

Checkpoints go through ``megatron.core.dist_checkpointing``: every tensor is stored by its global
name and shape, so a checkpoint written at one TP/PP layout loads into any other with the same
padded vocabulary (:func:`save_model_checkpoint`, :func:`load_model_checkpoint`).

The HF weights' mapping to these parameters lives with the weight-sync code (one converter per
architecture); here only the architecture is translated.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F

from megatron_rl.hf.arch import (
    QK_NORM_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    MLASettings,
    MoESettings,
    language_model_config,
    load_hf_config,
    mla_settings,
    moe_settings,
    padded_vocab_size,
    rope_parameters,
    yarn_settings,
)
from megatron_rl.training.parallel import ParallelConfig, process_groups

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any. They are written
    # out so that each signature says which Megatron object it takes.
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from transformers import PretrainedConfig

    from megatron_rl.hf.arch import HFConfigLike

__all__ = [
    "build_gpt_model",
    "build_model_chunks",
    "gpt_model_kwargs_from_hf",
    "have_transformer_engine",
    "load_model_checkpoint",
    "model_sharded_state_dict",
    "save_model_checkpoint",
    "transformer_config_from_hf",
    "unwrap_chunks",
]


#: A model chunk (GPTModel, bare or wrapped in DDP / Float16Module: all MegatronModules) or a list.
ModelChunks: TypeAlias = "MegatronModule | Sequence[MegatronModule]"


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _rope_model_kwargs(hf: PretrainedConfig) -> dict[str, float]:
    """GPTModel's RoPE arguments: ``rotary_base`` plus the scalings Megatron implements.

    - ``default``: none.
    - ``linear``: positions divided by ``factor`` (= ``seq_len_interpolation_factor``).
    - ``llama3``: Megatron's ``rope_scaling`` with ``factor``; Megatron hard-codes
      low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192, so other
      values are refused.
    """
    p = rope_parameters(hf)
    kw: dict[str, float] = {"rotary_base": p["rope_theta"]}
    kind = p["rope_type"]
    if kind == "default":
        return kw
    if kind == "linear":
        kw["seq_len_interpolation_factor"] = float(p["factor"])
        return kw
    if kind == "llama3":
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for name, value in fixed.items():
            if float(p.get(name, value)) != float(value):
                raise ValueError(
                    f"rope_scaling.{name}: Megatron's llama3 RoPE scaling fixes it at {value}, got {p[name]}"
                )
        kw.update(rope_scaling=True, rope_scaling_factor=float(p["factor"]))
        return kw
    raise ValueError(
        f"rope_scaling.rope_type: {kind!r} is not supported (supported: default, linear, llama3)"
    )


def _check_supported(hf: PretrainedConfig) -> None:
    """Raise ValueError naming the HF field when the architecture is not one this builds."""
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type: {hf.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {hf.hidden_act!r}")
    if getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias: biases on q/k/v/o projections are not supported")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias: MLP biases are not supported")
    if float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor: only 1.0 is supported, got {hf.partial_rotary_factor}")
    window = getattr(hf, "sliding_window", None)
    if hf.model_type.startswith("qwen") and not getattr(hf, "use_sliding_window", False):
        window = None  # Qwen configs carry a window that only applies with use_sliding_window
    if window is not None and window < hf.max_position_embeddings:
        raise ValueError(
            f"sliding_window: sliding-window attention ({window} tokens, smaller than "
            f"max_position_embeddings={hf.max_position_embeddings}) is not supported; set "
            "sliding_window=None, or max_position_embeddings <= sliding_window if no sequence "
            "is longer than the window (then full causal attention is the same thing)"
        )
    moe_settings(hf)  # refuses dense layers mixed into an MoE model, naming the field


def _moe_config_kwargs(moe: MoESettings, tensor_parallel: int, num_layers: int) -> dict[str, object]:
    """``TransformerConfig`` MoE arguments that compute what HF's Qwen3-MoE and Mixtral blocks compute.

    HF: ``p = softmax(router logits)`` over all experts, the top-k of ``p``, divided by their sum
    when ``norm_topk_prob``. Megatron with ``moe_router_pre_softmax=False`` takes the top-k of the
    logits and a softmax over those k -- the same renormalised weights, since softmax keeps the
    order and ``exp(l_i) / sum_topk exp(l_j) = p_i / sum_topk p_j``; with ``pre_softmax=True`` it
    is the top-k of ``p`` unnormalised. No token is dropped (no capacity factor), and the
    load-balancing loss is off: it changes no logit, and RL fine-tuning trains without it here.
    The "allgather" dispatcher runs on CPU over gloo; grouped GEMM needs CUDA kernels.

    DeepSeek-V3: ``sigmoid`` scores, the top-k chosen on ``score + e_score_correction_bias``
    (Megatron's ``expert_bias``, kept fixed: RL does not rebalance the experts), groups of
    experts scored by their two best (``n_group`` / ``topk_group``), the chosen scores divided by
    their sum and multiplied by ``routed_scaling_factor``, shared experts added, and the first
    ``first_k_dense_replace`` layers dense (``moe_layer_freq``).
    """
    if moe.ffn % tensor_parallel:
        raise ValueError(f"{moe.ffn_field}: {moe.ffn} is not divisible by tensor_parallel={tensor_parallel}")
    out = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function=moe.score_function,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    )
    if moe.score_function == "sigmoid":  # DeepSeek-V3 (see the docstring)
        if moe.shared_ffn % tensor_parallel:
            raise ValueError(
                f"n_shared_experts: their width {moe.shared_ffn} is not divisible by tensor_parallel={tensor_parallel}"
            )
        out.update(
            moe_router_enable_expert_bias=moe.expert_bias,
            moe_router_bias_update_rate=0.0,  # the bias is a fixed part of the checkpoint here
            moe_router_num_groups=moe.num_groups,
            moe_router_group_topk=moe.group_topk,
            moe_router_topk_scaling_factor=moe.scaling_factor,
            moe_router_dtype="fp32",  # transformers scores in fp32 whatever the model's dtype
            moe_shared_expert_intermediate_size=moe.shared_ffn or None,
            moe_layer_freq=[0] * moe.first_dense + [1] * (num_layers - moe.first_dense),
        )
    return out


def transformer_config_from_hf(
    hf_config: HFConfigLike,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for a Mistral / Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral HF config
    and a layout.

    RMSNorm (the config's eps), SwiGLU MLP, grouped-query attention, no linear biases except
    Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm (``qk_layernorm``), Qwen3-MoE's and Mixtral's experts
    (see :func:`_moe_config_kwargs`; split over ``parallel.expert_parallel`` ranks), no dropout (whatever the
    HF config says: RL training runs without it). On CPU, weights are initialised on the CPU from the default generator *before* sharding, so
    the initial model is the same at every TP size, and all fused kernels are off. ``overrides``
    are passed to ``TransformerConfig`` last (e.g. ``recompute_granularity="full"``).

    Raises ValueError naming the HF field for architectures it cannot express.
    """
    from megatron.core.transformer import (
        TransformerConfig,  # lazy: megatron-core takes seconds to import; only this path needs it
    )
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    hf = language_model_config(load_hf_config(hf_config))  # a vision-language model: its language model
    _check_supported(hf)
    mla = mla_settings(hf)
    if mla is None:
        _rope_model_kwargs(hf)  # validates rope settings early; they go to GPTModel, not here
    layers_per_stage = parallel.pipeline_parallel * (parallel.virtual_pipeline or 1)
    if hf.num_hidden_layers % layers_per_stage:
        raise ValueError(
            f"num_hidden_layers: {hf.num_hidden_layers} layers do not split evenly "
            f"into pipeline_parallel x virtual_pipeline = {layers_per_stage} chunks"
        )
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    split = [
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", hf.intermediate_size),
    ]
    if mla is not None:  # its down projections are column-parallel too
        split += [("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope)]
        split += [("q_lora_rank", mla.q_lora_rank)] if mla.q_lora_rank else []
    for name, n in split:
        if n % parallel.tensor_parallel:
            raise ValueError(f"{name}: {n} is not divisible by tensor_parallel={parallel.tensor_parallel}")
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, object] = dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        layernorm_zero_centered_gamma=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf.model_type == "qwen2",
        qk_layernorm=hf.model_type in QK_NORM_MODEL_TYPES,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf, "initializer_range", 0.02),
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,  # needs Apex's fused_weight_gradient_mlp_cuda
        # Fused kernels exist only on CUDA (Megatron falls back where a kernel is missing).
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=on_gpu and have_transformer_engine(),
    )
    moe = moe_settings(hf)
    if moe is not None:
        kwargs.update(_moe_config_kwargs(moe, parallel.tensor_parallel, hf.num_hidden_layers))
    if parallel.expert_parallel > 1 and moe is None:
        raise ValueError(
            f"expert_parallel: {parallel.expert_parallel} needs an MoE model; {hf.model_type!r} has no experts"
        )
    if moe is not None and moe.num_experts % parallel.expert_parallel:
        raise ValueError(
            f"expert_parallel: {parallel.expert_parallel} does not divide num_experts={moe.num_experts}"
        )
    kwargs["expert_model_parallel_size"] = parallel.expert_parallel
    if mla is not None:
        kwargs.update(_mla_config_kwargs(hf, mla))
    kwargs.update(overrides)
    return (MLATransformerConfig if mla is not None else TransformerConfig)(**kwargs)


def _mla_config_kwargs(hf: PretrainedConfig, mla: MLASettings) -> dict[str, object]:
    """``MLATransformerConfig`` arguments for DeepSeek's multi-latent attention: its ranks and
    head widths, and its RoPE -- plain, or YaRN with DeepSeek's attention scale (``mscale``,
    ``mscale_all_dim``), which Megatron's MLA applies as transformers does. The RoPE part of
    each head is de-interleaved before rotation by both (``rope_interleave``)."""
    rope = rope_parameters(hf)
    kind = rope["rope_type"]
    out: dict[str, object] = dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope,
        qk_pos_emb_head_dim=mla.qk_rope,
        v_head_dim=mla.v_dim,
        rotary_base=rope["rope_theta"],
        qk_layernorm=True,  # the q and kv latents' RMSNorms
    )
    if kind == "default":
        return {
            **out,
            "rope_type": "rope",
            "rotary_scaling_factor": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        }
    if kind != "yarn":
        raise ValueError(
            f"rope_scaling.rope_type: {kind!r} is not supported with MLA (supported: default, yarn)"
        )
    yarn = yarn_settings(rope, hf.max_position_embeddings)
    if yarn.attention_factor is not None:
        raise ValueError("rope_parameters.attention_factor: not supported with MLA (Megatron derives it)")
    return {
        **out,
        "rope_type": "yarn",
        "rotary_scaling_factor": yarn.factor,
        "original_max_position_embeddings": int(yarn.original_max_position_embeddings),
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "mscale": yarn.mscale or 1.0,
        "mscale_all_dim": yarn.mscale_all_dim,
    }


def gpt_model_kwargs_from_hf(
    hf_config: HFConfigLike, *, tensor_parallel: int, vocab_size: int | None = None
) -> dict[str, object]:
    """The ``GPTModel`` arguments that come from the HF config (vocabulary, positions, RoPE,
    tied embeddings); ``vocab_size`` overrides the config's (e.g. a resized tokenizer)."""
    hf = language_model_config(load_hf_config(hf_config))
    mla = mla_settings(hf) is not None  # multi-latent attention rotates inside itself
    return dict(
        vocab_size=padded_vocab_size(vocab_size or hf.vocab_size, tensor_parallel),
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="none" if mla else "rope",
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
        **({} if mla else _rope_model_kwargs(hf)),
    )


def _moe_without_transformer_engine() -> None:
    """Let Megatron-Core 0.16.1's router run without Transformer Engine.

    ``moe_utils`` imports ``te_general_gemm`` from TE inside a ``try`` and, when that fails, never
    defines the name, yet the router's gating function tests ``te_general_gemm is not None``: a
    NameError on every MoE forward without TE. Defining it as None selects the plain ``torch.mm``
    path the function already has.
    """
    from megatron.core.transformer.moe import (
        moe_utils,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mla_without_transformer_engine() -> None:
    """Let Megatron-Core 0.16.1's multi-latent attention run without Transformer Engine.

    ``multi_latent_attention`` sets ``HAVE_TE`` when ``megatron.core.extensions.transformer_engine``
    imports -- which it does without TE, with stand-ins -- and then tests
    ``isinstance(linear_proj, TELinear)`` against a stand-in that is no class: a TypeError while
    building every MLA layer. Without TE there is no TE layer to find.
    """
    from megatron.core.transformer import (
        multi_latent_attention,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    if not have_transformer_engine():
        multi_latent_attention.HAVE_TE = False


def _spec_kwargs(config: TransformerConfig) -> dict[str, object]:
    """The layer-spec arguments the family decides: q/k norms (Qwen3) and experts (Qwen3-MoE, Mixtral,
    one ``SequentialMLP`` of plain MLPs: grouped GEMM needs CUDA kernels)."""
    if config.num_moe_experts:
        _moe_without_transformer_engine()
    return dict(qk_layernorm=config.qk_layernorm, num_experts=config.num_moe_experts, moe_grouped_gemm=False)


def _layer_spec(
    config: TransformerConfig, vp_stage: int | None = None
) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer Engine layers where TE is importable, plain PyTorch ones otherwise; the plain
    ones attend with :class:`~megatron_rl.training.attention.SegmentCausalAttention` (SDPA per
    packed sequence, no ``[T, T]`` mask) instead of Megatron's ``DotProductAttention``.

    DeepSeek-V3 (multi-latent attention, leading dense layers among MoE ones): a spec per layer
    of the chunk (virtual stage ``vp_stage``), Megatron's ``get_gpt_decoder_block_spec``."""
    from megatron.core.models.gpt.gpt_layer_specs import (  # lazy: megatron-core takes seconds to import; only this path needs it
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_rl.training.attention import (
        SegmentCausalAttention,  # lazy: it imports megatron-core, which takes seconds; only this path needs it
    )

    if config.multi_latent_attention:
        _spec_kwargs(config)  # the MoE without TE
        _mla_without_transformer_engine()
        te = have_transformer_engine()
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage
        )
        if not te:
            for layer in block.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = SegmentCausalAttention
        return block
    if have_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec(**_spec_kwargs(config))
    if config.sequence_parallel:
        raise ValueError(
            "sequence_parallel: needs Transformer Engine (the plain PyTorch "
            "RMSNorm of Megatron's local layer spec does not support it)"
        )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", **_spec_kwargs(config))
    spec.submodules.self_attention.submodules.core_attention = SegmentCausalAttention
    return spec


def build_gpt_model(
    hf_config: HFConfigLike,
    parallel: ParallelConfig,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vocab_size: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    vp_stage: int | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    config: TransformerConfig | None = None,
) -> GPTModel:
    """One ``GPTModel`` chunk for this rank (needs :func:`init_parallel` first).

    ``pre_process`` / ``post_process`` default to "this is the first / last pipeline stage"
    (of virtual stage ``vp_stage`` under interleaving). ``pg_collection`` defaults to the groups
    made by ``init_parallel``; ``config`` to :func:`transformer_config_from_hf`. The output layer
    returns vocab-parallel logits (``parallel_output=True``).
    """
    from megatron.core import (
        parallel_state,  # lazy: megatron-core takes seconds to import; only this path needs it
    )
    from megatron.core.models.gpt import (
        GPTModel,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    if config is None:
        config = transformer_config_from_hf(hf_config, parallel, params_dtype=params_dtype)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config, vp_stage),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        pg_collection=pg_collection if pg_collection is not None else process_groups(),
        vp_stage=vp_stage,
        **gpt_model_kwargs_from_hf(
            hf_config, tensor_parallel=parallel.tensor_parallel, vocab_size=vocab_size
        ),
    )


def build_model_chunks(
    hf_config: HFConfigLike,
    parallel: ParallelConfig,
    *,
    vocab_size: int | None = None,
    params_dtype: torch.dtype = torch.float32,
) -> list[GPTModel]:
    """The model chunks of this rank, as Megatron's schedules take them: ``[model]`` without
    interleaving, ``virtual_pipeline`` chunks (virtual stages ``0..vpp-1``) with it."""
    config = transformer_config_from_hf(hf_config, parallel, params_dtype=params_dtype)
    stages: Iterable[int | None] = range(parallel.virtual_pipeline) if parallel.virtual_pipeline else [None]
    return [
        build_gpt_model(hf_config, parallel, vocab_size=vocab_size, vp_stage=stage, config=config)
        for stage in stages
    ]


def unwrap_chunks(model: ModelChunks) -> list[GPTModel]:
    """The bare ``GPTModel`` chunks of a chunk or list of chunks wrapped in DDP / Float16Module."""
    from megatron.core.utils import (
        unwrap_model,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    return unwrap_model(list(model) if isinstance(model, (list, tuple)) else [model])


def model_sharded_state_dict(chunks: Sequence[GPTModel]) -> ShardedStateDict:
    """The ``dist_checkpointing`` sharded state dict of (unwrapped) model chunks."""
    # With several chunks (interleaving) the python keys must not collide; the tensors inside
    # carry their global names (layer numbers include the chunk's offset), which is what the
    # checkpoint is keyed by, so the nesting does not leak into the files.
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_model_checkpoint(model: ModelChunks, path: str | os.PathLike[str]) -> None:
    """Write the model's weights to the folder ``path`` with ``dist_checkpointing`` (collective:
    every rank of the default group calls it). ``model`` is a chunk or a list of chunks,
    possibly wrapped in DDP / Float16Module. Not atomic: a crash mid-save leaves a partial folder.
    """
    from megatron.core import (
        dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(unwrap_chunks(model)), str(path))


def load_model_checkpoint(model: ModelChunks, path: str | os.PathLike[str]) -> None:
    """Load weights written by :func:`save_model_checkpoint` at any TP/PP layout into ``model``
    (collective). Every parameter must be in the checkpoint with the same global shape."""
    from megatron.core import (
        dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    chunks = unwrap_chunks(model)
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), str(path))
    if len(chunks) == 1:
        chunks[0].load_state_dict(state)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"])
