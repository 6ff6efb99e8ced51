"""GPTModel from HF configs on CPU (one rank): shapes, backward, the three families against the
Hugging Face implementation, unsupported configs, vocabulary padding and checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.hf.arch import padded_vocab_size
from megatron_rl.training.model import (
    build_gpt_model,
    gpt_model_kwargs_from_hf,
    load_model_checkpoint,
    save_model_checkpoint,
    transformer_config_from_hf,
)
from megatron_rl.training.parallel import ParallelConfig

VOCAB = 250
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def _ids(model, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and position ids ``[batch, seq]`` on the model's device (CPU here, GPU with CUDA)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids.to(device), torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)


def test_tiny_llama_forward_and_backward(single_rank):
    hf = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    model = build_gpt_model(hf, ParallelConfig())
    ids, pos = _ids(model, 2, 16)
    logits = model(ids, pos, None)
    assert logits.shape == (2, 16, padded_vocab_size(VOCAB, 1)) == (2, 16, 1024)
    assert torch.isfinite(logits).all()
    (logits**2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def _megatron_to_hf(model, hf) -> dict[str, torch.Tensor]:
    """Megatron GPTModel weights under HF Llama/Mistral/Qwen2 names (test-only mapping).

    Megatron's fused QKV holds, per query group, that group's query heads, then its key head,
    then its value head; fc1 is ``[gate; up]``; the padded vocabulary rows are dropped. With
    Transformer Engine layers the pre-attention / pre-MLP norms are fused into linear_qkv / fc1.
    """
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}

    def norm(layer: str, local: str, fused: str) -> torch.Tensor:
        return sd.get(f"{layer}{local}", sd.get(f"{layer}{fused}"))

    heads, groups = hf.num_attention_heads, hf.num_key_value_heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    split = [heads // groups * hd, hd, hd]
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][: hf.vocab_size],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
    }
    if not hf.tie_word_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"][: hf.vocab_size]
    for i in range(hf.num_hidden_layers):
        mg, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            fused = sd.get(f"{mg}self_attention.linear_qkv.{kind}")
            if fused is None:
                continue
            q, k, v = fused.reshape(groups, sum(split), -1).split(split, dim=1)
            for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{h}self_attn.{proj}.{kind}"] = t.reshape(-1, *fused.shape[1:])
        gate, up = sd[f"{mg}mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update(
            {
                f"{h}self_attn.o_proj.weight": sd[f"{mg}self_attention.linear_proj.weight"],
                f"{h}input_layernorm.weight": norm(
                    mg, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"
                ),
                f"{h}post_attention_layernorm.weight": norm(
                    mg, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"
                ),
                f"{h}mlp.gate_proj.weight": gate,
                f"{h}mlp.up_proj.weight": up,
                f"{h}mlp.down_proj.weight": sd[f"{mg}mlp.linear_fc2.weight"],
            }
        )
    return out


FAMILIES = {
    # Mistral with head_dim != hidden / heads (kv_channels path), untied.
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(head_dim=32, sliding_window=None, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False),
    ),
    # Llama with tied embeddings and Llama-3 RoPE scaling.
    "llama_tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 5e5,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    # Llama with linear RoPE scaling.
    "llama_linear": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
        ),
    ),
    # Qwen2 with its q/k/v biases (made nonzero below: Megatron initialises biases to 0).
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_hugging_face(single_rank, family):
    config_cls, model_cls, extra = FAMILIES[family]
    hf = config_cls(**{**TINY, **extra}, attn_implementation="eager")
    model = build_gpt_model(hf, ParallelConfig())
    names = dict(model.named_parameters())
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == (family == "qwen2")
    assert ("output_layer.weight" in names) == (not hf.tie_word_embeddings)
    with torch.no_grad():
        for name, p in names.items():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    ids, pos = _ids(model, 2, 24, seed=1)
    reference = model_cls(hf).to(ids.device).eval()
    missing, unexpected = reference.load_state_dict(_megatron_to_hf(model, hf), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        ours = model(ids, pos, None)[..., :VOCAB]
        theirs = reference(input_ids=ids).logits
    assert ours.abs().max() > 0.05  # the comparison below is not between near-zero tensors
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_config_translation_for_qwen2():
    hf = transformers.Qwen2Config(**TINY, rms_norm_eps=3e-6, initializer_range=0.01)
    cfg = transformer_config_from_hf(
        hf,
        ParallelConfig(tensor_parallel=2),
        params_dtype=torch.bfloat16,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 3e-6
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.hidden_dropout == cfg.attention_dropout == 0.0
    assert cfg.tensor_model_parallel_size == 2 and cfg.init_method_std == 0.01
    assert cfg.params_dtype == cfg.pipeline_dtype == torch.bfloat16 and cfg.bf16
    assert cfg.recompute_granularity == "full"  # overrides reach TransformerConfig
    if not torch.cuda.is_available():
        assert cfg.use_cpu_initialization
        assert not (
            cfg.bias_activation_fusion
            or cfg.masked_softmax_fusion
            or cfg.bias_dropout_fusion
            or cfg.apply_rope_fusion
        )


def test_model_kwargs_from_config_folder(tmp_path):
    # A config.json in the transformers-4 layout: top-level rope_theta, no rope_scaling.
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 300, '
        '"rope_theta": 123456.0, "rope_scaling": null, "max_position_embeddings": 512, '
        '"tie_word_embeddings": true}'
    )
    kw = gpt_model_kwargs_from_hf(str(tmp_path), tensor_parallel=2)
    assert kw == dict(
        vocab_size=1024,
        max_sequence_length=512,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
        rotary_base=123456.0,
    )
    assert gpt_model_kwargs_from_hf(str(tmp_path), tensor_parallel=1, vocab_size=1000)["vocab_size"] == 1024
    with pytest.raises(ValueError, match="config.json"):
        gpt_model_kwargs_from_hf(str(tmp_path / "missing"), tensor_parallel=1)


@pytest.mark.parametrize(
    "vocab, tp, padded",
    [
        (250, 1, 1024),
        (250, 2, 1024),
        (1025, 1, 2048),
        (1024, 8, 1024),
        (151936, 8, 152576),
        (1, 4, 1024),
        (250, 3, 3072),
    ],
)
def test_padded_vocab_size_does_not_depend_on_tp(vocab, tp, padded):
    # One padded size for TP 1, 2, 4, 8: a checkpoint resumes at any of them.
    assert padded_vocab_size(vocab, tp) == padded
    assert padded_vocab_size(250, 128, divisible_by=1, resume_tp=1) == 256


UNSUPPORTED = [
    (
        transformers.MistralConfig(**{**TINY, "max_position_embeddings": 32768}, sliding_window=4096),
        ParallelConfig(),
        "sliding_window",
    ),
    (
        transformers.LlamaConfig(
            **TINY,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 64,
            },
        ),
        ParallelConfig(),
        "rope_type",
    ),
    (
        transformers.LlamaConfig(
            **{**TINY, "max_position_embeddings": 16384},
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 5e5,
                "low_freq_factor": 2.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        ParallelConfig(),
        "low_freq_factor",
    ),
    (transformers.LlamaConfig(**TINY, attention_bias=True), ParallelConfig(), "attention_bias"),
    (transformers.LlamaConfig(**TINY, mlp_bias=True), ParallelConfig(), "mlp_bias"),
    (transformers.LlamaConfig(**TINY, hidden_act="gelu"), ParallelConfig(), "hidden_act"),
    (transformers.GPT2Config(), ParallelConfig(), "model_type"),
    (
        transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 3}),
        ParallelConfig(pipeline_parallel=2),
        "num_hidden_layers",
    ),
    (
        transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1}),
        ParallelConfig(tensor_parallel=2),
        "num_key_value_heads",
    ),
    (
        transformers.LlamaConfig(**{**TINY, "intermediate_size": 129}),
        ParallelConfig(tensor_parallel=2),
        "intermediate_size",
    ),
]


@pytest.mark.parametrize("hf, parallel, field", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_configs_name_the_field(hf, parallel, field):
    with pytest.raises(ValueError, match=field):
        transformer_config_from_hf(hf, parallel)


def test_qwen2_window_applies_only_with_use_sliding_window():
    hf = transformers.Qwen2Config(**TINY)
    hf.sliding_window = 32  # what Qwen2 config.json files carry with use_sliding_window false
    transformer_config_from_hf(hf, ParallelConfig())
    hf.use_sliding_window = True
    with pytest.raises(ValueError, match="sliding_window"):
        transformer_config_from_hf(hf, ParallelConfig())


def test_checkpoint_round_trip(single_rank, tmp_path):
    hf = transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
    saved = build_gpt_model(hf, ParallelConfig())
    save_model_checkpoint(saved, tmp_path / "ckpt")
    loaded = build_gpt_model(hf, ParallelConfig())
    before = dict(loaded.named_parameters())
    assert any(not torch.equal(p, before[n]) for n, p in saved.named_parameters())
    load_model_checkpoint(loaded, tmp_path / "ckpt")
    for name, p in saved.named_parameters():
        assert torch.equal(p, dict(loaded.named_parameters())[name]), name
