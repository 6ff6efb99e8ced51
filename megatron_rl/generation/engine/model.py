"""A plain-PyTorch decoder (Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral / DeepSeek-V3;
Mistral3's language model) with HF parameter names and a per-slot KV cache.

The built-in engine's model. It computes what transformers' ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` and
``MixtralForCausalLM`` compute (RMSNorm, SwiGLU MLP, rotary embeddings with the config's
``rope_theta`` and ``head_dim``, grouped-query attention, tied or untied embeddings, Qwen2's q/k/v
biases, Qwen3's per-head q/k RMSNorm before RoPE, the MoE families' softmax top-k router over
SwiGLU experts; DeepSeek-V3's multi-latent attention, YaRN, sigmoid router and shared experts),
in fp32, and its parameters carry exactly the names transformers saves
(per-expert ``mlp.experts.e.gate_proj``, Mixtral's ``block_sparse_moe.experts.e.w1``, as in the
files, not transformers 5's fused in-memory experts), so that a weight broadcast can assign
HF-named tensors in place through :meth:`Decoder.named_weights`.

The KV cache (:class:`KVCache`) is contiguous: ``[layers, slots, kv_heads, max_len, head_dim]``.
A *slot* holds one running sequence; ``lengths[slot]`` is how many of its positions are valid.
:meth:`Decoder.forward` appends ``T`` new tokens to each of ``B`` slots at once (prefill: ``T =
prompt length``; decode: ``B = running slots, T = 1``); each row's positions start at its own
slot length, and each query sees only keys of its own slot up to its own position, so sequences
of different lengths share one decode step. Positions beyond a slot's length hold stale values of
a previous occupant; the mask, not zeroing, keeps them out.

``slots`` is either a tensor of slot indices (any slots, in any order: their keys are gathered)
or an int ``n``, meaning slots ``0 .. n-1``: attention then reads the cache in place, a strided
view with no copy of the prefixes (the engine keeps its running sequences in the leading slots
for this; :meth:`KVCache.move` and :meth:`KVCache.fork` are its tools). With ``last_only`` the
output head runs on the last position only (a prefill needs no other logits).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl.hf.arch import (
    CARRIED_PREFIXES,
    MOE_MODEL_TYPES,
    QK_NORM_MODEL_TYPES,
    TEXT_PREFIXES,
    MLASettings,
    MoESettings,
    YarnSettings,
    language_model_dict,
    mla_settings,
    moe_settings,
    yarn_settings,
)
from megatron_rl.hf.files import HFWeights, read_config_json

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["Decoder", "DecoderConfig", "KVCache"]

_SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")


@dataclass(kw_only=True)
class DecoderConfig:
    """The shape of a decoder of one of the supported families, read from an HF
    ``config.json``."""

    model_type: str  # one of _SUPPORTED
    vocab_size: int  # rows of the embedding and of the output head
    hidden_size: int  # residual-stream width
    intermediate_size: int  # SwiGLU inner width
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention: divides num_heads)
    head_dim: int  # width of one head (HF default: hidden_size // num_heads)
    rope_theta: float = 10000.0  # rotary base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # output head shares the embedding matrix
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama with attention_bias)
    o_bias: bool = False  # output projection has a bias (Llama with attention_bias only)
    mlp_bias: bool = False  # MLP projections have biases (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over each query / key head before RoPE (Qwen3)
    num_experts: int = 0  # experts per MoE layer; 0: a dense MLP
    num_experts_per_tok: int = 0  # experts each token goes to (top-k)
    moe_intermediate_size: int = 0  # one expert's SwiGLU inner width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    sliding_window: int | None = None  # Mistral/Qwen2 window; sequences must fit inside it
    eos_token_ids: tuple[int, ...] = ()  # from config.json, for the engine's default stop set
    #: a vision-language checkpoint's language model: the prefix of its tensors' names, and the
    #: prefixes of the tensors it has besides (vision tower, projector), which the engine does
    #: not load: it serves text prompts only
    weight_prefix: str = ""
    carried_prefixes: tuple[str, ...] = ()
    #: the MoE settings whole (DeepSeek-V3's sigmoid router, bias, groups, shared experts and
    #: leading dense layers among them; None for a dense model), DeepSeek's multi-latent
    #: attention and its YaRN RoPE (None for the other families)
    moe: MoESettings | None = None
    mla: MLASettings | None = None
    yarn: YarnSettings | None = None

    @property
    def k_head_dim(self) -> int:
        """Width of one cached key head (MLA: the no-RoPE part plus the RoPE part)."""
        return self.mla.qk_nope + self.mla.qk_rope if self.mla else self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Width of one cached value head."""
        return self.mla.v_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a head."""
        return self.mla.qk_rope if self.mla else self.head_dim

    def __post_init__(self):
        if self.model_type not in _SUPPORTED:
            raise ValueError(f"model_type: {self.model_type!r} is not one of {_SUPPORTED}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: must divide num_heads ({self.num_heads}), got {self.num_kv_heads}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if (self.model_type in MOE_MODEL_TYPES) != (self.num_experts > 0):
            raise ValueError(
                f"num_experts: {self.model_type} needs num_experts >= 1 exactly when it is an MoE "
                f"family, got {self.num_experts}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size: must be >= 1, got {self.moe_intermediate_size}")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, JsonValue]) -> DecoderConfig:
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout). A
        vision-language config (Mistral3) gives its language model."""
        whole_type = cfg.get("model_type", "")
        cfg = language_model_dict(cfg)
        model_type = cfg.get("model_type", "")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported, got {cfg['hidden_act']!r}")
        # transformers 5 nests the rotary settings in rope_parameters; 4.x had rope_theta and
        # rope_scaling at the top level. Scaled variants (llama3, ...) change the frequencies and
        # are not implemented: refuse rather than silently differ. DeepSeek's YaRN is.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mla = mla_settings(cfg)
        if rope_type != "default" and not (mla is not None and rope_type == "yarn"):
            raise ValueError(f"rope_type: only 'default' rotary embeddings are supported, got {rope_type!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if theta is None:
            raise ValueError("rope_theta: null in config.json, a number is needed")
        num_heads = cfg["num_attention_heads"]
        # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias covers all four.
        qwen = model_type == "qwen2"
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window that applies only with use_sliding_window
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        moe = moe_settings(cfg)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=float(theta),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            eos_token_ids=eos_ids,
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            num_experts=moe.num_experts if moe else 0,
            num_experts_per_tok=moe.top_k if moe else 0,
            moe_intermediate_size=moe.ffn if moe else 0,
            norm_topk_prob=moe.norm_topk_prob if moe else False,
            weight_prefix=TEXT_PREFIXES.get(whole_type, ""),
            carried_prefixes=CARRIED_PREFIXES.get(whole_type, ()),
            moe=moe,
            mla=mla,
            yarn=yarn_settings(rope, cfg.get("max_position_embeddings")) if rope_type == "yarn" else None,
        )


def _yarn(yarn: YarnSettings, theta: float, mla: MLASettings) -> tuple[torch.Tensor, float, float]:
    """YaRN as transformers computes it for DeepSeek: ``(inverse frequencies of the RoPE part,
    the factor the rotary tables are multiplied by, the softmax scale)``."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, dim = yarn.factor, mla.qk_rope
    attention = yarn.attention_factor
    if attention is None:
        both = yarn.mscale and yarn.mscale_all_dim
        attention = (
            mscale(factor, yarn.mscale) / mscale(factor, yarn.mscale_all_dim) if both else mscale(factor)
        )

    def correction(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction(yarn.beta_fast), correction(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    scale = (mla.qk_nope + mla.qk_rope) ** -0.5
    if yarn.mscale_all_dim:
        scale *= mscale(factor, yarn.mscale_all_dim) ** 2
    return inv_freq, attention, scale


class KVCache:
    """Contiguous per-slot keys and values.

    ``k``, ``v``: ``[layers, slots, kv_heads, max_len, head_dim]`` (a slot's positions of one head
    are contiguous rows, so the leading ``n`` slots' first ``L`` positions are a view SDPA reads
    in place); ``lengths``: ``[slots]`` (int64), the valid prefix of each slot. Freeing a slot only
    resets its length.
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if slots < 1 or max_len < 1:
            raise ValueError(f"slots and max_len: must be >= 1, got {slots} and {max_len}")
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len)
        self.k = torch.zeros((*shape, cfg.k_head_dim), dtype=dtype, device=device)
        self.v = torch.zeros((*shape, cfg.v_head_dim), dtype=dtype, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.slots = slots
        self.max_len = max_len

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache can hold: ``slots * max_len``."""
        return self.slots * self.max_len

    def reset(self, slot: int) -> None:
        """Forget slot ``slot``'s sequence (its stale values stay, masked out by length)."""
        self.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Move slot ``src``'s sequence to slot ``dst`` (``src`` is then empty)."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def fork(self, src: int, dsts: list[int], length: int | None = None) -> None:
        """Copy slot ``src``'s sequence (its first ``length`` positions: a running sibling's
        prompt) into every slot of ``dsts`` (a group's shared prompt, prefilled once: the copies
        hold bit for bit the keys and values ``src`` holds)."""
        if not dsts:
            return
        n = int(self.lengths[src]) if length is None else length
        index = torch.tensor(dsts, dtype=torch.long, device=self.k.device)
        self.k[:, index, :, :n] = self.k[:, src : src + 1, :, :n]
        self.v[:, index, :, :n] = self.v[:, src : src + 1, :, :n]
        self.lengths[index] = n


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as transformers does, so bf16
        # weights would round at the same place.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3: one RMSNorm of width head_dim, shared by the heads, on q and k before RoPE.
        self.q_norm = _RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = _RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None


class _MLAttention(nn.Module):
    """DeepSeek's multi-latent attention, under transformers' names: queries through the rank
    ``q_lora_rank`` bottleneck ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or one
    ``q_proj``), keys and values from the latent of ``kv_a_proj_with_mqa`` (its last
    ``qk_rope_head_dim`` columns: the RoPE key shared by every head) through ``kv_a_layernorm`` and
    ``kv_b_proj``. The cache holds the expanded keys and values (no latent caching)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        mla, n, h = cast("MLASettings", cfg.mla), cfg.num_heads, cfg.hidden_size
        q_width = n * (mla.qk_nope + mla.qk_rope)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = _RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope, bias=False)
        self.kv_a_layernorm = _RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, n * (mla.qk_nope + mla.v_dim), bias=False)
        self.o_proj = nn.Linear(n * mla.v_dim, h, bias=False)
        self.mla = mla

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, T, hidden]`` -> rotated ``q, k [B, T, heads, nope + rope]`` and ``v [B, T,
        heads, v]``; the RoPE parts de-interleaved first (pairs to halves), as transformers'
        ``apply_rotary_pos_emb_interleave``."""
        mla = self.mla
        B, T, _ = x.shape
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, -1, mla.qk_nope + mla.qk_rope)
        q_nope, q_rot = q.split([mla.qk_nope, mla.qk_rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, -1, mla.qk_nope + mla.v_dim)
        k_nope, v = kv.split([mla.qk_nope, mla.v_dim], dim=-1)
        q_rot, k_rot = (_rotate_interleaved(t, cos, sin) for t in (q_rot, k_rot[:, :, None, :]))
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return torch.cat([q_nope, q_rot], dim=-1), k, v


def _rotate_interleaved(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs, written out as halves (DeepSeek's layout)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    t1, t2 = t[..., 0::2], t[..., 1::2]
    return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)


class _MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, intermediate_size: int | None = None):
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MixtralExpert(nn.Module):
    """One Mixtral expert: the SwiGLU of :class:`_MLP` under its files' names (w1 gate, w3 up,
    w2 down)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nn.Linear(h, i, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _MoE(nn.Module):
    """Qwen3-MoE's and Mixtral's sparse block: ``gate`` (the router, ``[E, hidden]``) and
    ``experts.e``."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            _MixtralExpert(cfg) if cfg.model_type == "mixtral" else _MLP(cfg, cfg.moe_intermediate_size)
            for _ in range(cfg.num_experts)
        )
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.moe = cfg.moe if cfg.moe is not None and cfg.moe.score_function == "sigmoid" else None
        if self.moe is not None:  # DeepSeek-V3: the score-correction bias and the shared experts
            self.gate.register_parameter(
                "e_score_correction_bias", nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
            )
            self.shared_experts = _MLP(cfg, self.moe.shared_ffn) if self.moe.shared_ffn else None
        self.routed: torch.Tensor | None = None  # [N, top_k] int32: the last forward's experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> the weighted sum of each token's top-k experts, same shape.

        As transformers: softmax over all experts in fp32, top-k of those probabilities, divided
        by their sum with ``norm_topk_prob``; each expert runs once on the tokens routed to it.
        """
        flat = x.reshape(-1, x.shape[-1])
        if self.moe is not None:
            weights, chosen = self._sigmoid_route(flat)
        else:
            probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        self.routed = chosen.to(torch.int32)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            expert = cast("_MLP | _MixtralExpert", self.experts[e])
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.moe is not None and self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(x.shape)

    def _sigmoid_route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router, as transformers: fp32 sigmoid scores; the choice on scores plus
        the correction bias, first of the ``topk_group`` groups whose two best sum highest; the
        chosen scores renormalised and scaled by ``routed_scaling_factor``."""
        moe = cast("MoESettings", self.moe)
        scores = torch.sigmoid(F.linear(flat.float(), self.gate.weight.float()))
        choice = scores + cast(torch.Tensor, self.gate.e_score_correction_bias).float()
        if moe.num_groups:
            grouped = choice.view(choice.shape[0], moe.num_groups, -1)
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=cast(int, moe.group_topk), dim=-1)[1]
            keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).bool()
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        chosen = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * (moe.scaling_factor or 1.0), chosen


class _Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: _Attention | _MLAttention = (
            _MLAttention(cfg) if cfg.mla is not None else _Attention(cfg)
        )
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = not cfg.num_experts or (cfg.moe is not None and not cfg.moe.is_moe_layer(layer))
        mlp: nn.Module = _MLP(cfg) if dense else _MoE(cfg)
        # Mixtral's files name its sparse block "block_sparse_moe"; the parameters follow them.
        self.mlp_name = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
        self.add_module(self.mlp_name, mlp)

    @property
    def ffn(self) -> nn.Module:
        """The MLP or sparse block, whatever its name."""
        return self.get_submodule(self.mlp_name)


class _Backbone(nn.Module):
    # Named "model" inside Decoder so parameter names read "model.layers.0...." like HF's.
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class _Where:
    """Where one forward's tokens go and what they see (computed once, shared by the layers)."""

    dense: bool  # slots are 0 .. B-1: attention reads the cache in place
    slots: torch.Tensor  # [B] slot of each row
    positions: torch.Tensor  # [B, T] absolute positions
    length: int  # keys to read per slot (the longest row's new length)
    mask: torch.Tensor | None  # [B, 1, T, length] True = may attend; None: plain causal
    cos: torch.Tensor  # [B, T, 1, head_dim]
    sin: torch.Tensor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Decoder(nn.Module):
    """A causal LM of one of the supported families over a :class:`KVCache`; parameters
    named as in HF's files."""

    inv_freq: torch.Tensor  # a buffer (register_buffer below), declared for the type checker

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        # Tied: no lm_head parameter at all (HF does not save one), the head reads the embedding.
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # HF's inv_freq: theta ** -(2i / d) for i < d/2, computed from an int64 arange in fp32
        # (d: the rotated width; YaRN's own frequencies for DeepSeek).
        d, mla = cfg.rope_dim, cfg.mla
        exponent = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        inv_freq = 1.0 / (cfg.rope_theta**exponent)
        self.rope_factor = 1.0  # YaRN's factor on the rotary tables
        self.attn_scale = None if mla is None else (mla.qk_nope + mla.qk_rope) ** -0.5  # None: SDPA's
        if cfg.yarn is not None and mla is not None:
            inv_freq, self.rope_factor, self.attn_scale = _yarn(cfg.yarn, cfg.rope_theta, mla)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)
        #: an MoE model's routing of the last :meth:`forward`: ``[B, T, layers, top_k]`` int32, the
        #: experts each position was sent to in each layer (None for a dense model)
        self.last_routed: torch.Tensor | None = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> Decoder:
        """Load ``config.json`` and the safetensors weights (single file or sharded index)."""
        folder = Path(folder)
        cfg = DecoderConfig.from_hf(read_config_json(folder, flag="model"))
        model = cls(cfg)
        weights = HFWeights(folder)
        try:
            model.load_state_dict(weights)
        finally:
            weights.close()
        return model

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The live parameters by HF name; ``named_weights()[n].copy_(t)`` updates the model.

        With tied embeddings there is no ``lm_head.weight`` entry: the head is the embedding. A
        vision-language model's names carry its language model's prefix, as in its files.
        """
        prefix = self.cfg.weight_prefix
        return {prefix + name: p for name, p in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Copy HF-named tensors into the parameters (cast to their dtype).

        Accepts exactly what transformers saves: every parameter must be present, and the only
        extras tolerated are ``lm_head.weight`` of a tied model (must equal the embedding),
        rotary ``inv_freq`` buffers of older checkpoints, which are recomputed here anyway, and a
        vision-language model's vision tower and projector (not loaded: text prompts only).
        ``strict`` and ``assign`` exist for signature compatibility; loading is always strict.
        """
        params = self.named_weights()
        prefix, carried = self.cfg.weight_prefix, self.cfg.carried_prefixes
        head, embedding = f"{prefix}lm_head.weight", f"{prefix}model.embed_tokens.weight"
        missing = sorted(set(params) - set(state))
        extra = []
        for name in state:
            if name in params or name.endswith("rotary_emb.inv_freq"):
                continue
            if carried and name.startswith(carried):
                continue
            if name == head and self.lm_head is None:
                continue  # compared with the embedding once that is loaded, below
            extra.append(name)
        if missing or extra:
            raise KeyError(
                f"state dict does not match the model: missing {missing[:8]}, unexpected {extra[:8]}"
            )
        with torch.no_grad():
            for name, p in params.items():
                t = state[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))
        if self.lm_head is None and head in state:
            embed = params[embedding]
            if not torch.equal(state[head].to(embed.dtype), embed):
                raise ValueError(f"{head}: differs from {embedding} but the config says tie_word_embeddings")
        return None

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` -> ``cos, sin [B, T, 1, head_dim]`` (HF's duplicated-half layout)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        if self.rope_factor != 1.0:
            return emb.cos() * self.rope_factor, emb.sin() * self.rope_factor
        return emb.cos(), emb.sin()

    def _attend(
        self,
        layer: int,
        block: _Block,
        x: torch.Tensor,
        cache: KVCache,
        at: _Where,
    ) -> torch.Tensor:
        """Self-attention of ``x [B, T, hidden]`` that writes its K/V into ``cache`` first.

        ``at`` says where: the rows' slots, absolute positions and rotary tables, and the mask
        (``None``: plain causal, every row a fresh prompt of ``T`` tokens). Returns ``[B, T, hidden]``.
        """
        cfg, attn = self.cfg, block.self_attn
        B, T, _ = x.shape
        if isinstance(attn, _MLAttention):
            q, k, v = attn.qkv(x, at.cos, at.sin)
        else:
            q = attn.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
            k = attn.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
            v = attn.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
            if attn.q_norm is not None and attn.k_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * at.cos + _rotate_half(q) * at.sin
            k = k * at.cos + _rotate_half(k) * at.sin
        # Scatter the new keys/values to (slot, position): [B, T, kv_heads, head_dim] lands on
        # the cache's [slot, :, position] entries.
        ck, cv = cache.k[layer], cache.v[layer]
        rows = at.slots[:, None]  # [B, 1] against positions [B, T]
        ck[rows, :, at.positions] = k.to(ck.dtype)
        cv[rows, :, at.positions] = v.to(cv.dtype)
        if at.dense:  # slots 0 .. B-1: a view of the cache, nothing copied
            keys, values = ck[:B, :, : at.length], cv[:B, :, : at.length]
        else:
            keys, values = ck[at.slots, :, : at.length], cv[at.slots, :, : at.length]
        # Grouped-query attention inside SDPA: no copy of the keys/values per query head.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=at.mask,
            is_causal=at.mask is None,
            enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            scale=self.attn_scale,
        )
        return attn.o_proj(out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.v_head_dim))

    def forward(
        self,
        input_ids: torch.Tensor,
        slots: torch.Tensor | int,
        cache: KVCache,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Append ``input_ids [B, T]`` to ``slots`` of ``cache``; return logits ``[B, T, V]``
        (``[B, 1, V]``, the last position's, with ``last_only``).

        ``slots``: a ``[B]`` tensor of slot indices, or the int ``B`` for slots ``0 .. B-1`` (read
        in place). Row ``b``'s tokens take positions ``lengths[slot] .. + T - 1``; the slot
        lengths grow by ``T``. Every row appends the same ``T`` (prefill prompts of one length,
        or decode one token for many).
        """
        B, T = input_ids.shape
        dense = isinstance(slots, int)
        if isinstance(slots, int):
            if slots != B:
                raise ValueError(f"slots: {slots} leading slots for {B} rows")
            index = torch.arange(B, device=cache.lengths.device)
        else:
            index = slots.to(cache.lengths.device)
        start = (cache.lengths[:B] if dense else cache.lengths[index]).clone()  # [B]
        end = int(start.max()) + T
        if end > cache.max_len:
            raise ValueError(f"sequence would reach {end} tokens; the cache holds {cache.max_len} per slot")
        if self.cfg.sliding_window is not None and end > self.cfg.sliding_window:
            raise ValueError(
                f"sequence would reach {end} tokens, beyond sliding_window "
                f"{self.cfg.sliding_window} (windowed attention is not implemented)"
            )
        positions = start[:, None] + torch.arange(T, device=start.device)  # [B, T]
        # Causal and per-slot: query at position p sees keys 0..p of its own slot, and nothing of
        # the stale tail beyond its slot's new length. Fresh prompts (every row starts at 0) are
        # plain causal attention, which SDPA does without a mask.
        if end == T:
            mask = None
        else:
            key_pos = torch.arange(end, device=start.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        cos, sin = self._rope(positions)
        at = _Where(
            dense=dense,
            slots=index,
            positions=positions,
            length=end,
            mask=mask,
            cos=cos,
            sin=sin,
        )
        x = self.model.embed_tokens(input_ids)
        routed = []
        # _Backbone fills its ModuleList with _Blocks only; the list's iterator is typed as Modules.
        for i, block in enumerate(cast("Iterable[_Block]", self.model.layers)):
            x = x + self._attend(i, block, block.input_layernorm(x), cache, at)
            x = x + block.ffn(block.post_attention_layernorm(x))
            if isinstance(block.ffn, _MoE) and block.ffn.routed is not None:
                routed.append(block.ffn.routed.view(B, T, -1))
            elif self.cfg.num_experts:  # a dense layer of an MoE model: zeros, as SGLang reports
                routed.append(
                    torch.zeros(B, T, self.cfg.num_experts_per_tok, dtype=torch.int32, device=x.device)
                )
        # Every position's experts, layer by layer (what SGLang's return_routed_experts reports).
        self.last_routed = torch.stack(routed, dim=2) if routed else None  # [B, T, layers, top_k]
        cache.lengths[index] = start + T
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of whole sequences ``input_ids [B, T]`` (one pass, scratch cache)."""
        B, T = input_ids.shape
        cache = KVCache(
            self.cfg, slots=B, max_len=T, dtype=self.model.norm.weight.dtype, device=input_ids.device
        )
        return self.forward(input_ids, torch.arange(B, device=input_ids.device), cache)
