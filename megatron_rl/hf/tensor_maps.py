"""The HF <-> Megatron-Core tensor tables, as data: how a layer's names are spelt on either side,
which HF tensors make up each Megatron tensor in every supported family, and every tensor's shape
in named dimensions. :mod:`megatron_rl.hf.layout` builds each architecture's converter from them;
nothing here computes anything.

Megatron names are canonical (:func:`~megatron_rl.hf.layout.canonical_name`: TP=1, PP=1, global
layer numbers). HF names are those of the safetensors files (and of SGLang's loaders).

The map, for one layer ``i`` (h = hidden_size, f = intermediate_size, n = num_attention_heads,
g = num_key_value_heads, d = head_dim, V = vocab_size, Vp = padded vocabulary):

- ``embedding.word_embeddings.weight [Vp, h]`` <-> ``model.embed_tokens.weight [V, h]``: rows
  ``V..Vp`` are Megatron's vocabulary padding (zeros when made from HF, dropped going to HF).
- ``decoder.layers.i.self_attention.linear_qkv.weight [(n + 2g) d, h]`` <-> ``q_proj [n d, h]``,
  ``k_proj [g d, h]``, ``v_proj [g d, h]``: Megatron interleaves per query group -- for each of
  the g groups, its n/g query heads, then its key head, then its value head. Qwen2's ``.bias``
  ``[(n + 2g) d]`` follows the same layout.
- ``...linear_proj.weight [h, n d]`` <-> ``o_proj``; ``...linear_fc1.weight [2f, h]`` <->
  ``[gate_proj; up_proj]``; ``...linear_fc2.weight [h, f]`` <-> ``down_proj``.
- the pre-attention / pre-MLP norms ``[h]`` <-> ``input_layernorm`` / ``post_attention_layernorm``;
  ``decoder.final_layernorm.weight`` <-> ``model.norm.weight``.
- ``output_layer.weight [Vp, h]`` <-> ``lm_head.weight [V, h]``; with tied embeddings there is no
  ``lm_head`` and the last pipeline stage's copy of the embedding maps to nothing.
- Qwen3 / Qwen3-MoE: ``...self_attention.q_layernorm.weight [d]`` / ``k_layernorm`` <->
  ``self_attn.q_norm`` / ``k_norm`` (one RMSNorm shared by every head, before RoPE).
- Qwen3-MoE (E = num_experts, m = moe_intermediate_size): ``...mlp.router.weight [E, h]`` <->
  ``mlp.gate.weight``; expert ``e``'s ``...mlp.experts.local_experts.e.linear_fc1.weight [2m, h]``
  <-> ``[mlp.experts.e.gate_proj; mlp.experts.e.up_proj]`` and ``linear_fc2 [h, m]`` <->
  ``mlp.experts.e.down_proj``. The HF names are those of the files (and of SGLang's loader):
  transformers >= 5 fuses the experts into 3-D ``gate_up_proj`` / ``down_proj`` parameters in
  memory and splits them again on save. Expert numbers are global (no expert parallelism).
- Mixtral (E = num_local_experts, m = intermediate_size): the same Megatron tensors from its
  files' ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.e.w1`` (gate),
  ``w3`` (up), ``w2`` (down) -- the names SGLang's Mixtral loader reads too.
- DeepSeek-V3: multi-latent attention in the place of ``linear_qkv`` (``linear_q_down_proj`` /
  ``q_layernorm`` / ``linear_q_up_proj`` <-> ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, or
  ``linear_q_proj`` <-> ``q_proj`` without the query bottleneck; ``linear_kv_down_proj`` /
  ``kv_layernorm`` / ``linear_kv_up_proj`` <-> ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
  ``kv_b_proj``, all 1:1), ``first_k_dense_replace`` dense layers, then MoE layers with
  ``mlp.router.expert_bias`` <-> ``mlp.gate.e_score_correction_bias`` and
  ``mlp.shared_experts.linear_fc1/fc2`` <-> ``mlp.shared_experts.{gate,up,down}_proj``.
- Mistral3 (vision-language): its language model is a Mistral whose every HF name above carries
  the prefix ``language_model.`` (``language_model.model.layers.i...``,
  ``language_model.lm_head.weight``: the files' names, which SGLang's Mistral3 loader routes to
  its language model); the ``vision_tower.`` and ``multi_modal_projector.`` tensors are not
  converted (:meth:`~megatron_rl.hf.layout.HFConverter.is_carried`): they travel beside the Megatron model, bit for bit.

Shapes are tuples of dimension names (``"h"``, ``"2f"``, ``"qkv"`` ...) that
:class:`~megatron_rl.hf.layout.HFConverter` turns into sizes from the config, each with the
config field that fixes it, so that a wrong size is reported as that field.
"""

from __future__ import annotations

import re

__all__ = [
    "DEEPSEEK_V3_HF_SHAPES",
    "DEEPSEEK_V3_MCORE_SHAPES",
    "EMBEDDING",
    "EXPERT_BIAS",
    "EXPERT_NUMBER",
    "FINAL_NORM",
    "GLOBAL_MAP",
    "HF_EXPERT",
    "HF_LAYER",
    "HF_SHAPES",
    "IGNORED_HF_SUFFIXES",
    "LAYER_MAP",
    "MCORE_EXPERT",
    "MCORE_LAYER",
    "MCORE_SHAPES",
    "MIXTRAL_MOE_MAP",
    "MLA_KV",
    "MLA_Q_LORA",
    "MLA_Q_PROJ",
    "MOE_MAP",
    "OUTPUT",
    "QK_NORM_MAP",
    "SHARED_EXPERTS",
]

# A layer's parameter names: ``decoder.layers.<i>.<suffix>`` (Megatron), ``model.layers.<i>.<suffix>``
# (HF).
MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# An expert's number inside a per-layer suffix, either side (replaced by "E" for shape lookups).
EXPERT_NUMBER = re.compile(r"(?<=experts\.)\d+(?=\.)")
HF_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
MCORE_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")

# Per-layer Megatron suffix -> the HF suffixes (under ``model.layers.i.``) it is made of.
LAYER_MAP: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
# Qwen3's per-head q/k norms, and Qwen3-MoE's router and experts (E: the expert's number).
QK_NORM_MAP = {
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
}
MOE_MAP = {
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.experts.local_experts.E.linear_fc1.weight": (
        "mlp.experts.E.gate_proj.weight",
        "mlp.experts.E.up_proj.weight",
    ),
    "mlp.experts.local_experts.E.linear_fc2.weight": ("mlp.experts.E.down_proj.weight",),
}
# Mixtral's files name the same tensors after the original release: w1 = gate, w3 = up, w2 = down.
MIXTRAL_MOE_MAP = {
    "mlp.router.weight": ("block_sparse_moe.gate.weight",),
    "mlp.experts.local_experts.E.linear_fc1.weight": (
        "block_sparse_moe.experts.E.w1.weight",
        "block_sparse_moe.experts.E.w3.weight",
    ),
    "mlp.experts.local_experts.E.linear_fc2.weight": ("block_sparse_moe.experts.E.w2.weight",),
}
# DeepSeek-V3: multi-latent attention in the place of the fused QKV (queries through a rank
# q_lora_rank bottleneck, or one projection when it is null; keys and values from a latent), the
# router's expert bias (a buffer in Megatron, added to the scores for the choice only) and
# shared experts.
MLA_Q_LORA: dict[str, tuple[str, ...]] = {
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight",),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight",),
}
MLA_Q_PROJ: dict[str, tuple[str, ...]] = {"self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight",)}
MLA_KV: dict[str, tuple[str, ...]] = {
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight",),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight",),
}
EXPERT_BIAS = {"mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",)}
SHARED_EXPERTS = {
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight",),
}
EMBEDDING, FINAL_NORM, OUTPUT = (
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
)
GLOBAL_MAP = {
    EMBEDDING: "model.embed_tokens.weight",
    FINAL_NORM: "model.norm.weight",
    OUTPUT: "lm_head.weight",
}

# HF tensors that are not weights and carry nothing to convert (non-persistent RoPE buffers that
# some older checkpoints saved anyway).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)

# Every HF weight's shape: the global names, and the layer suffixes (after ``model.layers.i.``;
# E: an expert's number).
HF_SHAPES: dict[str, tuple[str, ...]] = {
    "model.embed_tokens.weight": ("V", "h"),
    "lm_head.weight": ("V", "h"),
    "model.norm.weight": ("h",),
    "input_layernorm.weight": ("h",),
    "post_attention_layernorm.weight": ("h",),
    "mlp.gate_proj.weight": ("f", "h"),
    "mlp.up_proj.weight": ("f", "h"),
    "mlp.down_proj.weight": ("h", "f"),
    "self_attn.q_proj.weight": ("q", "h"),
    "self_attn.k_proj.weight": ("kv", "h"),
    "self_attn.v_proj.weight": ("kv", "h"),
    "self_attn.o_proj.weight": ("h", "q"),
    "self_attn.q_proj.bias": ("q",),
    "self_attn.k_proj.bias": ("kv",),
    "self_attn.v_proj.bias": ("kv",),
    "self_attn.q_norm.weight": ("d",),
    "self_attn.k_norm.weight": ("d",),
    "mlp.gate.weight": ("E", "h"),
    "mlp.experts.E.gate_proj.weight": ("m", "h"),
    "mlp.experts.E.up_proj.weight": ("m", "h"),
    "mlp.experts.E.down_proj.weight": ("h", "m"),
    "block_sparse_moe.gate.weight": ("E", "h"),
    "block_sparse_moe.experts.E.w1.weight": ("m", "h"),
    "block_sparse_moe.experts.E.w3.weight": ("m", "h"),
    "block_sparse_moe.experts.E.w2.weight": ("h", "m"),
}
# Every Megatron weight's shape: the global names, and the canonical layer suffixes (after
# ``decoder.layers.i.``; E: an expert's number).
MCORE_SHAPES: dict[str, tuple[str, ...]] = {
    EMBEDDING: ("Vp", "h"),
    OUTPUT: ("Vp", "h"),
    FINAL_NORM: ("h",),
    "self_attention.linear_qkv.layer_norm_weight": ("h",),
    "mlp.linear_fc1.layer_norm_weight": ("h",),
    "self_attention.linear_qkv.weight": ("qkv", "h"),
    "self_attention.linear_qkv.bias": ("qkv",),
    "self_attention.linear_proj.weight": ("h", "q"),
    "mlp.linear_fc1.weight": ("2f", "h"),
    "mlp.linear_fc2.weight": ("h", "f"),
    "self_attention.q_layernorm.weight": ("d",),
    "self_attention.k_layernorm.weight": ("d",),
    "mlp.router.weight": ("E", "h"),
    "mlp.experts.local_experts.E.linear_fc1.weight": ("2m", "h"),
    "mlp.experts.local_experts.E.linear_fc2.weight": ("h", "m"),
}

# DeepSeek-V3: multi-latent attention's projections and norms, the router's bias and the
# shared experts, on top of the shapes above.
DEEPSEEK_V3_HF_SHAPES: dict[str, tuple[str, ...]] = {
    **HF_SHAPES,
    "self_attn.q_proj.weight": ("qup", "h"),
    "self_attn.o_proj.weight": ("h", "ov"),
    "self_attn.q_a_proj.weight": ("ql", "h"),
    "self_attn.q_a_layernorm.weight": ("ql",),
    "self_attn.q_b_proj.weight": ("qup", "ql"),
    "self_attn.kv_a_proj_with_mqa.weight": ("kvd", "h"),
    "self_attn.kv_a_layernorm.weight": ("kvl",),
    "self_attn.kv_b_proj.weight": ("kvup", "kvl"),
    "mlp.gate.e_score_correction_bias": ("E",),
    "mlp.shared_experts.gate_proj.weight": ("s", "h"),
    "mlp.shared_experts.up_proj.weight": ("s", "h"),
    "mlp.shared_experts.down_proj.weight": ("h", "s"),
}
DEEPSEEK_V3_MCORE_SHAPES: dict[str, tuple[str, ...]] = {
    **MCORE_SHAPES,
    "self_attention.linear_proj.weight": ("h", "ov"),
    "self_attention.linear_q_proj.weight": ("qup", "h"),
    "self_attention.linear_q_down_proj.weight": ("ql", "h"),
    "self_attention.q_layernorm.weight": ("ql",),
    "self_attention.linear_q_up_proj.weight": ("qup", "ql"),
    "self_attention.linear_kv_down_proj.weight": ("kvd", "h"),
    "self_attention.kv_layernorm.weight": ("kvl",),
    "self_attention.linear_kv_up_proj.weight": ("kvup", "kvl"),
    "mlp.router.expert_bias": ("E",),
    "mlp.shared_experts.linear_fc1.weight": ("2s", "h"),
    "mlp.shared_experts.linear_fc2.weight": ("h", "s"),
}
