"""The HF <-> Megatron map: hand-computed layouts, TP sharding against Megatron's own parameter
attributes, pipeline layer offsets against Megatron's, round trips, and forward equality with
transformers at TP=1 (multi-rank layouts: tests/convert/test_layouts.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.hf.layout import HFConverter, WeightsMismatchError, canonical_name, local_spec_name
from megatron_rl.hf.sharding import (
    TPSplit,
    gather_from_tp,
    layer_offset,
    shard_for_tp,
    to_global_name,
    to_local_name,
    tp_split,
)
from megatron_rl.training.chunks import chunk_global_names, chunk_tensors, chunk_to_hf, load_hf_into_chunk
from tests.data.tinylm import build_model, mistral3_config

VOCAB = 1000  # pads to 1024 rows: padding exercised, and ids land on both halves at TP=2
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "mistral": (
        transformers.MistralConfig,  # head_dim 32 != hidden / heads = 16
        dict(head_dim=32, sliding_window=None, tie_word_embeddings=False),
    ),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),  # q/k norms
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,  # 4 experts, top 2, renormalised, as the released models
        dict(
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # Mistral3: the Mistral language model of a vision-language checkpoint (its vision tower is
    # carried: see tests/data/tinylm.py's mistral3_config)
    "mistral3": (
        transformers.MistralConfig,
        dict(head_dim=32, sliding_window=None, tie_word_embeddings=False),
    ),
    # DeepSeek-V3: MLA (q and kv latents), a dense first layer, then MoE layers of a sigmoid router
    # with a score-correction bias, groups of experts (2 groups, 1 chosen) and a shared expert.
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            routed_scaling_factor=1.5,
            num_key_value_heads=4,  # MLA: every head its own key and value
            tie_word_embeddings=False,
        ),
    ),
    # ... with YaRN RoPE and DeepSeek's attention scale (mscale), as the released models
    "deepseek_v3_yarn": (
        transformers.DeepseekV3Config,
        dict(
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,  # no query bottleneck (DeepSeek-V2-Lite's layout)
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=4,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,  # 4 experts of intermediate_size, top 2, always renormalised
        dict(
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),
}


def hf_model(family: str, seed: int = 0, **overrides):
    """A random HF model whose biases and norms are random too (HF initialises them to 0 / 1),
    and whose MoE routers are far from uniform; ``overrides`` change the config (e.g.
    ``num_hidden_layers``)."""
    cls, extra = FAMILIES[family]
    config = cls(**{**TINY, **extra, **overrides}, attn_implementation="eager")
    if family == "mistral3":
        config = mistral3_config(config, attn_implementation="eager")
    torch.manual_seed(seed)
    model = build_model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # transformers initialises it to zero
                b.normal_(0.0, 0.3)
    return model


def hf_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors by the names its safetensors files use (transformers >= 5 fuses MoE
    experts into 3-D parameters in memory and splits them again on save; this does the same)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def test_qkv_and_fc1_layout_by_hand():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: per group [q, q, k, v].
    config = transformers.Qwen2Config(
        hidden_size=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=1,
        intermediate_size=2,
        num_hidden_layers=1,
        vocab_size=3,
    )
    conv = HFConverter.for_config(config)
    col = lambda *v: torch.tensor(v, dtype=torch.float32).reshape(-1, 1)
    hf = {
        "model.layers.0.self_attn.q_proj.weight": col(0, 1, 2, 3),
        "model.layers.0.self_attn.k_proj.weight": col(10, 11),
        "model.layers.0.self_attn.v_proj.weight": col(20, 21),
        "model.layers.0.self_attn.q_proj.bias": torch.tensor([0.0, 1, 2, 3]),
        "model.layers.0.self_attn.k_proj.bias": torch.tensor([10.0, 11]),
        "model.layers.0.self_attn.v_proj.bias": torch.tensor([20.0, 21]),
        "model.layers.0.mlp.gate_proj.weight": col(5, 6),
        "model.layers.0.mlp.up_proj.weight": col(7, 8),
    }
    qkv = conv.hf_to_mcore(
        hf,
        [
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.linear_qkv.bias",
            "decoder.layers.0.mlp.linear_fc1.weight",
        ],
    )
    assert qkv["decoder.layers.0.self_attention.linear_qkv.weight"].flatten().tolist() == [
        0,
        1,
        10,
        20,
        2,
        3,
        11,
        21,
    ]
    assert qkv["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert qkv["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == [5, 6, 7, 8]
    # Rank r of TP=2 holds query group r ([q, q, k, v]) and [gate_r; up_r].
    fc1 = qkv["decoder.layers.0.mlp.linear_fc1.weight"]
    assert shard_for_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2).flatten().tolist() == [6, 8]
    assert shard_for_tp(
        "decoder.layers.0.self_attention.linear_qkv.weight",
        qkv["decoder.layers.0.self_attention.linear_qkv.weight"],
        1,
        2,
    ).flatten().tolist() == [2, 3, 11, 21]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_and_shapes(family):
    model = hf_model(family)
    hf = hf_state(model)
    conv = HFConverter.for_config(model.config)
    mcore = conv.hf_to_mcore(hf)
    assert {n: tuple(t.shape) for n, t in mcore.items()} == conv.expected_mcore_shapes()
    assert mcore["embedding.word_embeddings.weight"].shape[0] == 1024
    assert not mcore["embedding.word_embeddings.weight"][VOCAB:].any()  # padding rows are zero
    back = dict(pair for n, t in mcore.items() for pair in conv.mcore_to_hf(n, t))
    tied_head = conv.lm_head_hf_name if conv.dims.tied else None
    expected = {n for n in hf if n != tied_head and not conv.is_carried(n)}  # Mistral3: its LM
    assert set(back) == expected == set(conv.hf_names())
    for name in expected:
        assert torch.equal(back[name], hf[name]), name
    conv.check_hf_weights({n: t.shape for n, t in hf.items()})
    conv.check_mcore_weights({n: t.shape for n, t in mcore.items()})


@pytest.mark.parametrize(
    "split, name",
    [
        (TPSplit.COLUMN, "decoder.layers.3.self_attention.linear_qkv.weight"),
        (TPSplit.COLUMN, "embedding.word_embeddings.weight"),
        (TPSplit.ROW, "decoder.layers.0.mlp.linear_fc2.weight"),
        (TPSplit.SWIGLU, "decoder.layers.0.mlp.linear_fc1.weight"),
        (TPSplit.REPLICATED, "decoder.layers.0.input_layernorm.weight"),
    ],
)
@pytest.mark.parametrize("tp", [2, 4])
def test_shard_gather_round_trip(split, name, tp):
    assert tp_split(name) is split
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    shards = [shard_for_tp(name, full, r, tp) for r in range(tp)]
    if split is not TPSplit.REPLICATED:
        assert sum(s.numel() for s in shards) == full.numel()
    assert torch.equal(gather_from_tp(name, shards), full)
    if split is not TPSplit.REPLICATED:  # 6 rows / columns (3 per SwiGLU half) do not split in 4
        with pytest.raises(ValueError, match="does not split"):
            shard_for_tp(name, torch.zeros(6, 6), 0, 4)


def test_unknown_names_are_errors():
    with pytest.raises(KeyError, match="tensor-parallel"):
        tp_split("decoder.layers.0.self_attention.q_layernorm_nope")
    conv = HFConverter.for_config(hf_model("llama").config)
    with pytest.raises(KeyError, match="not a weight"):
        conv.mcore_to_hf("decoder.layers.7.mlp.linear_fc2.weight", torch.zeros(64, 128))
    with pytest.raises(WeightsMismatchError, match="intermediate_size"):
        conv.mcore_to_hf("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(64, 100))


def test_names_and_pipeline_offsets():
    local = "decoder.layers.1.input_layernorm.weight"
    assert canonical_name(local) == "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert local_spec_name(canonical_name(local)) == local
    assert to_global_name(local, 6) == "decoder.layers.7.input_layernorm.weight"
    assert (
        to_local_name("decoder.layers.7.mlp.linear_fc2.weight", 6, 2)
        == "decoder.layers.1.mlp.linear_fc2.weight"
    )
    assert to_local_name("decoder.layers.8.mlp.linear_fc2.weight", 6, 2) is None
    assert to_local_name("output_layer.weight", 6, 2) == "output_layer.weight"
    # Against Megatron's own offsets (even splits, with and without interleaving).
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for layers, pp, vpp in [(8, 2, None), (8, 2, 2), (12, 3, 2), (8, 4, None), (16, 2, 4)]:
        cfg = TransformerConfig(
            num_layers=layers,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
        )
        for r in range(pp):
            for v in range(vpp) if vpp else [None]:
                assert layer_offset(
                    layers, pp_rank=r, pp_size=pp, vp_stage=v, vp_size=vpp
                ) == get_transformer_layer_offset(cfg, vp_stage=v, pp_rank=r), (layers, pp, r, v)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_yarn"])
def test_tp_layout_agrees_with_megatron_parameters(single_rank, family):
    from megatron_rl.training.model import build_gpt_model
    from megatron_rl.training.parallel import ParallelConfig

    model = build_gpt_model(hf_model(family).config, ParallelConfig())
    seen = set()
    for name, p in model.named_parameters():
        split = tp_split(name)
        seen.add(split)
        if split is TPSplit.REPLICATED:
            assert not getattr(p, "tensor_model_parallel", False), name
        else:
            assert p.tensor_model_parallel, name
            assert p.partition_dim == (1 if split is TPSplit.ROW else 0), name
    assert seen == set(TPSplit)
    names = chunk_global_names(model)
    assert sorted(names.values()) == sorted(HFConverter.for_config(hf_model(family).config).mcore_names())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_matches_transformers_at_tp1(single_rank, family):
    from megatron_rl.training.model import build_gpt_model
    from megatron_rl.training.parallel import ParallelConfig

    reference = hf_model(family)
    conv = HFConverter.for_config(reference.config)
    model = build_gpt_model(reference.config, ParallelConfig())
    hf = hf_state(reference)
    assert load_hf_into_chunk(model, conv, hf, tp_rank=0, tp_size=1) == len(chunk_tensors(model))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, torch.arange(12).expand(2, 12), None)[..., :VOCAB]
        theirs = reference(input_ids=ids).logits
    assert theirs.abs().max() > 0.05
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    back = dict(chunk_to_hf(model, conv))
    assert set(back) == set(conv.hf_names())
    assert all(torch.equal(back[n], hf[n]) for n in back)


def test_qwen3_moe_names_and_mismatches_by_field():
    conv = HFConverter.for_config(hf_model("qwen3_moe").config)
    assert conv.hf_sources("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    assert conv.hf_sources("decoder.layers.0.mlp.router.weight") == ("model.layers.0.mlp.gate.weight",)
    assert conv.hf_sources("decoder.layers.0.self_attention.k_layernorm.weight") == (
        "model.layers.0.self_attn.k_norm.weight",
    )
    assert tp_split("decoder.layers.0.mlp.router.weight") is TPSplit.REPLICATED
    assert tp_split("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight") is TPSplit.SWIGLU
    assert tp_split("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight") is TPSplit.ROW
    assert tp_split("decoder.layers.0.self_attention.q_layernorm.weight") is TPSplit.REPLICATED
    shapes = {n: t.shape for n, t in hf_state(hf_model("qwen3_moe")).items()}
    with pytest.raises(WeightsMismatchError, match="num_experts") as err:
        HFConverter.for_config(hf_model("qwen3_moe", num_experts=8).config).check_hf_weights(shapes)
    assert err.value.field == "num_experts"
    with pytest.raises(WeightsMismatchError, match="moe_intermediate_size"):
        HFConverter.for_config(hf_model("qwen3_moe", moe_intermediate_size=16).config).check_hf_weights(
            shapes
        )
    with pytest.raises(WeightsMismatchError, match="head_dim"):
        HFConverter.for_config(hf_model("qwen3", head_dim=16).config).check_hf_weights(
            {n: t.shape for n, t in hf_state(hf_model("qwen3")).items()}
        )
    # Dense Qwen3 weights under the MoE config: the experts are missing, named as such.
    with pytest.raises(WeightsMismatchError, match="num_experts"):
        conv.check_hf_weights({n: t.shape for n, t in hf_state(hf_model("qwen3")).items()})


def test_mixtral_names_are_its_files_and_mismatches_name_its_fields():
    conv = HFConverter.for_config(hf_model("mixtral").config)
    assert conv.hf_sources("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == (
        "model.layers.1.block_sparse_moe.experts.3.w1.weight",  # gate first, as Megatron's fc1
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    )
    assert conv.hf_sources("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight") == (
        "model.layers.1.block_sparse_moe.experts.0.w2.weight",
    )
    assert conv.hf_sources("decoder.layers.0.mlp.router.weight") == (
        "model.layers.0.block_sparse_moe.gate.weight",
    )
    state = hf_state(hf_model("mixtral"))
    assert set(state) == set(conv.hf_names())  # what save_pretrained writes, no more, no less
    shapes = {n: t.shape for n, t in state.items()}
    # An expert's width is Mixtral's intermediate_size (there is no moe_intermediate_size).
    with pytest.raises(WeightsMismatchError, match="intermediate_size=64") as err:
        HFConverter.for_config(hf_model("mixtral", intermediate_size=64).config).check_hf_weights(shapes)
    assert err.value.field == "intermediate_size"
    with pytest.raises(WeightsMismatchError, match="num_experts"):
        HFConverter.for_config(hf_model("mixtral", num_local_experts=8).config).check_hf_weights(shapes)
    config = hf_model("mixtral").config
    config.router_jitter_noise = 0.1  # training-time routing noise: experts the generators never used
    with pytest.raises(ValueError, match="router_jitter_noise"):
        HFConverter.for_config(config)


@pytest.mark.parametrize(
    "field, value",
    [("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("num_experts_per_tok", 5)],
)
def test_moe_structures_we_cannot_build_are_refused_by_field(field, value):
    config = hf_model("qwen3_moe").config
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        HFConverter.for_config(config)


def test_transformer_engines_mla_norm_names_map_to_the_canonical_ones():
    """On a GPU, TE's MLA layers hold the latent norms inside the up projections: the same HF
    tensors, the same TP layout (replicated)."""
    conv = HFConverter.for_config(hf_model("deepseek_v3").config)
    for te, local, hf in (
        ("linear_q_up_proj.layer_norm_weight", "q_layernorm.weight", "q_a_layernorm.weight"),
        ("linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight", "kv_a_layernorm.weight"),
    ):
        name = f"decoder.layers.1.self_attention.{te}"
        assert canonical_name(name) == f"decoder.layers.1.self_attention.{local}"
        assert conv.hf_sources(canonical_name(name)) == (f"model.layers.1.self_attn.{hf}",)
        assert tp_split(name) is TPSplit.REPLICATED
