"""Hugging Face <-> Megatron-Core names and layouts, one converter per architecture.

The single source of truth for how a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral
``*ForCausalLM``
state dict (as saved in safetensors files) maps onto
the ``GPTModel`` of :mod:`megatron_rl.training.model`. The offline checkpoint converter
(:mod:`megatron_rl.convert`) and the live weight broadcast to the generators both go through it;
nothing here reads or writes files.

Megatron names used here ("canonical" names) are those of a TP=1, PP=1 model, with global layer
numbers and the Transformer Engine spelling of the two pre-norms, which is also how
``dist_checkpointing`` stores them under either layer spec. Megatron-Core 0.16.1's *module* names
differ between the specs for exactly those two norms:

==============================================  ==========================================
TE spec (= canonical, = checkpoint keys)        local spec (plain PyTorch layers)
==============================================  ==========================================
``self_attention.linear_qkv.layer_norm_weight``  ``input_layernorm.weight``
``mlp.linear_fc1.layer_norm_weight``             ``pre_mlp_layernorm.weight``
==============================================  ==========================================

Every function taking a Megatron name accepts both spellings (:func:`canonical_name`).

The tables behind the map (which HF tensors make up each Megatron tensor, family by family, and
every tensor's shape) are :mod:`megatron_rl.hf.tensor_maps`; how the full tensors this map
converts are split over tensor- and pipeline-parallel ranks is :mod:`megatron_rl.hf.sharding`.
Here: the canonical spelling, the sizes read from an HF config (:class:`ModelDims`), and one
:class:`HFConverter` per architecture (:data:`CONVERTERS`) -- its names, its conversions and its
shape checks, which name the config field behind a wrong dimension.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from megatron_rl.hf.arch import (
    CARRIED_PREFIXES,
    TEXT_PREFIXES,
    MLASettings,
    language_model_config,
    load_hf_config,
    mla_settings,
    moe_settings,
    padded_vocab_size,
)
from megatron_rl.hf.tensor_maps import (
    DEEPSEEK_V3_HF_SHAPES,
    DEEPSEEK_V3_MCORE_SHAPES,
    EMBEDDING,
    EXPERT_BIAS,
    EXPERT_NUMBER,
    FINAL_NORM,
    GLOBAL_MAP,
    HF_EXPERT,
    HF_LAYER,
    HF_SHAPES,
    IGNORED_HF_SUFFIXES,
    LAYER_MAP,
    MCORE_EXPERT,
    MCORE_LAYER,
    MCORE_SHAPES,
    MIXTRAL_MOE_MAP,
    MLA_KV,
    MLA_Q_LORA,
    MLA_Q_PROJ,
    MOE_MAP,
    OUTPUT,
    QK_NORM_MAP,
    SHARED_EXPERTS,
)

if TYPE_CHECKING:
    from megatron_rl.hf.arch import HFConfigLike

__all__ = [
    "CONVERTERS",
    "DeepseekV3Converter",
    "HFConverter",
    "LlamaConverter",
    "Mistral3Converter",
    "MistralConverter",
    "MixtralConverter",
    "ModelDims",
    "Qwen2Converter",
    "Qwen3Converter",
    "Qwen3MoeConverter",
    "WeightsMismatchError",
    "canonical_name",
    "local_spec_name",
]

# Local-spec module names of the two pre-norms -> the TE / checkpoint spelling.
_LOCAL_TO_FUSED = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_FUSED_TO_LOCAL = {v: k for k, v in _LOCAL_TO_FUSED.items()}
# Transformer Engine's MLA layers fuse the q / kv latent norms into the up projections.
_TE_MLA_NORMS = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


class WeightsMismatchError(ValueError):
    """A config does not describe the weights it goes with; ``field`` names the config field(s)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# --------------------------------------------------------------------------- spellings


def canonical_name(name: str) -> str:
    """The canonical (TE-spec, checkpoint) spelling of a Megatron parameter name. Multi-latent
    attention's latent norms are the exception: canonical is the local spec's ``q_layernorm`` /
    ``kv_layernorm``, which TE fuses into the up projections (``linear_q_up_proj.layer_norm_weight``)."""
    m = MCORE_LAYER.match(name)
    if m and m.group(2) in _LOCAL_TO_FUSED:
        return f"decoder.layers.{m.group(1)}.{_LOCAL_TO_FUSED[m.group(2)]}"
    if m and m.group(2) in _TE_MLA_NORMS:
        return f"decoder.layers.{m.group(1)}.{_TE_MLA_NORMS[m.group(2)]}"
    return name


def local_spec_name(name: str) -> str:
    """The local-spec module spelling of a Megatron parameter name (inverse of canonical)."""
    m = MCORE_LAYER.match(name)
    if m and m.group(2) in _FUSED_TO_LOCAL:
        return f"decoder.layers.{m.group(1)}.{_FUSED_TO_LOCAL[m.group(2)]}"
    return name


# --------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class ModelDims:
    """The sizes that fix every tensor's shape (read from an HF config)."""

    model_type: str
    hidden: int  # hidden_size
    ffn: int  # intermediate_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim, or hidden_size / num_attention_heads
    head_dim_explicit: bool  # whether the config sets head_dim
    vocab: int  # vocab_size
    padded_vocab: int  # Megatron's padded vocabulary (rows of the embedding / output layer)
    layers: int  # num_hidden_layers
    tied: bool  # tie_word_embeddings
    experts: int = 0  # num_experts of an MoE family (0: dense MLPs)
    moe_ffn: int = 0  # one expert's SwiGLU inner width
    moe_ffn_field: str = "moe_intermediate_size"  # the config field that gives moe_ffn
    shared_ffn: int = 0  # DeepSeek-V3: the shared experts' width (0: none)
    first_dense: int = 0  # DeepSeek-V3: leading layers with a dense MLP
    mla: MLASettings | None = None  # DeepSeek-V3: multi-latent attention (None: grouped-query)

    @classmethod
    def from_hf_config(
        cls, hf_config: HFConfigLike, *, tensor_parallel: int = 1, padded_vocab: int | None = None
    ) -> ModelDims:
        """``padded_vocab`` defaults to :func:`padded_vocab_size` at ``tensor_parallel``. A
        vision-language config gives its language model's dimensions (``model_type`` stays the
        whole model's)."""
        whole = load_hf_config(hf_config)
        hf = language_model_config(whole)
        heads = hf.num_attention_heads
        explicit = getattr(hf, "head_dim", None)
        vocab = hf.vocab_size
        padded = padded_vocab if padded_vocab is not None else padded_vocab_size(vocab, tensor_parallel)
        moe = moe_settings(hf)
        if padded < vocab:
            raise WeightsMismatchError(
                "vocab_size", f"vocab_size={vocab} is larger than the padded vocabulary of {padded} rows"
            )
        return cls(
            model_type=whole.model_type,
            hidden=hf.hidden_size,
            ffn=hf.intermediate_size,
            heads=heads,
            kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=explicit or hf.hidden_size // heads,
            head_dim_explicit=bool(explicit),
            vocab=vocab,
            padded_vocab=padded,
            layers=hf.num_hidden_layers,
            tied=bool(getattr(hf, "tie_word_embeddings", False)),
            experts=moe.num_experts if moe else 0,
            moe_ffn=moe.ffn if moe else 0,
            moe_ffn_field=moe.ffn_field if moe else "moe_intermediate_size",
            shared_ffn=moe.shared_ffn if moe else 0,
            first_dense=moe.first_dense if moe else 0,
            mla=mla_settings(hf),
        )


@dataclass(frozen=True)
class _Dim:
    """One expected dimension: its size, the config field(s) that fix it, and how they do
    (``how`` ends in the size, e.g. ``"num_attention_heads=8 x head_dim=16 = 128"``)."""

    size: int
    fields: str
    how: str


class HFConverter:
    """Names, layouts and shape checks for one architecture; build one with :meth:`for_config`.

    Megatron tensors here are full (TP-gathered) with global layer numbers. Subclasses differ in
    which optional tensors exist (Qwen2's q/k/v biases, Qwen3's q/k norms, Qwen3-MoE's experts).
    """

    model_type: ClassVar[str] = ""
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False  # per-head RMSNorm on q and k (Qwen3)
    moe: ClassVar[bool] = False  # router + experts instead of the dense MLP (Qwen3-MoE)
    #: the MoE tensors' HF names (with ``E`` for the expert's number), when ``moe``
    moe_map: ClassVar[dict[str, tuple[str, ...]]] = MOE_MAP
    expert_bias: ClassVar[bool] = False  # the router's score-correction bias (DeepSeek-V3)
    #: prefix of every HF name of the language model (a vision-language family's files)
    prefix: ClassVar[str] = ""
    #: prefixes of the HF tensors carried through untouched (a vision tower), never converted
    carried: ClassVar[tuple[str, ...]] = ()

    def __init__(self, dims: ModelDims):
        if dims.model_type != self.model_type:
            raise ValueError(
                f"model_type: {type(self).__name__} converts {self.model_type!r}, got {dims.model_type!r}"
            )
        if dims.heads % dims.kv_heads:
            raise WeightsMismatchError(
                "num_key_value_heads", f"{dims.kv_heads} does not divide num_attention_heads={dims.heads}"
            )
        if self.moe != (dims.experts > 0):
            raise WeightsMismatchError(
                "num_experts", f"{self.model_type!r} needs num_experts >= 1 exactly when it is an MoE family"
            )
        self.dims = dims
        # Per-layer suffix maps: the dense layers' and the MoE layers' (DeepSeek-V3 has both).
        self._dense_map = self._per_layer_map(moe_layer=False)
        self._moe_map = self._per_layer_map(moe_layer=True) if self.moe else self._dense_map

    @staticmethod
    def for_config(
        hf_config: HFConfigLike, *, tensor_parallel: int = 1, padded_vocab: int | None = None
    ) -> HFConverter:
        """The converter for an HF config (object or folder); see :class:`ModelDims` for the
        padded vocabulary. Raises ValueError naming the field for what it cannot map."""
        hf = load_hf_config(hf_config)
        if hf.model_type not in CONVERTERS:
            raise ValueError(
                f"model_type: {hf.model_type!r} is not supported (supported: {', '.join(CONVERTERS)})"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(language_model_config(hf), flag, False):
                raise ValueError(f"{flag}: {hf.model_type} with {flag}=true is not supported")
        dims = ModelDims.from_hf_config(hf, tensor_parallel=tensor_parallel, padded_vocab=padded_vocab)
        return CONVERTERS[hf.model_type](dims)

    # ----------------------------------------------------------------- names

    def _per_layer_map(self, *, moe_layer: bool) -> dict[str, tuple[str, ...]]:
        """Per-layer Megatron suffix -> its HF suffixes for this family's dense or MoE layers, in
        model order."""
        out: dict[str, tuple[str, ...]] = {}
        mla = self.dims.mla
        for suffix, sources in LAYER_MAP.items():
            if suffix == "self_attention.linear_qkv.weight" and mla is not None:
                out.update(MLA_Q_PROJ if mla.q_lora_rank is None else MLA_Q_LORA)
                out.update(MLA_KV)
                continue
            if suffix.endswith("linear_qkv.bias") and (mla is not None or not self.qkv_bias):
                continue
            if moe_layer and suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
                continue
            out[suffix] = sources
            if suffix == "self_attention.linear_proj.weight" and self.qk_norm:
                out.update(QK_NORM_MAP)
        if moe_layer:  # the router (and its bias), then expert by expert, then the shared experts
            out["mlp.router.weight"] = self.moe_map["mlp.router.weight"]
            if self.expert_bias:
                out.update(EXPERT_BIAS)
            per_expert = [(k, v) for k, v in self.moe_map.items() if ".E." in k]
            for e in range(self.dims.experts):
                for suffix, sources in per_expert:
                    out[suffix.replace(".E.", f".{e}.")] = tuple(s.replace(".E.", f".{e}.") for s in sources)
            if self.dims.shared_ffn:
                out.update(SHARED_EXPERTS)
        return out

    def _map_for(self, layer: int) -> dict[str, tuple[str, ...]]:
        """Layer ``layer``'s suffix map (DeepSeek-V3's leading layers are dense)."""
        return self._moe_map if self.moe and layer >= self.dims.first_dense else self._dense_map

    def mcore_names(self) -> list[str]:
        """Canonical names of every Megatron weight, in model order (embedding, layers, final
        norm, output layer unless tied)."""
        names = [EMBEDDING]
        for i in range(self.dims.layers):
            names += [f"decoder.layers.{i}.{s}" for s in self._map_for(i)]
        names.append(FINAL_NORM)
        if not self.dims.tied:
            names.append(OUTPUT)
        return names

    def hf_sources(self, mcore_name: str) -> tuple[str, ...]:
        """The HF tensors that make up Megatron tensor ``mcore_name`` (either spelling). The
        last stage's copy of a tied embedding (``output_layer.weight``) comes from
        ``model.embed_tokens.weight``."""
        name = canonical_name(mcore_name)
        if name == OUTPUT and self.dims.tied:
            return (self.prefix + GLOBAL_MAP[EMBEDDING],)
        if name in GLOBAL_MAP:
            return (self.prefix + GLOBAL_MAP[name],)
        m = MCORE_LAYER.match(name)
        layer = int(m.group(1)) if m else -1
        if not m or layer >= self.dims.layers or m.group(2) not in self._map_for(layer):
            raise KeyError(
                f"{mcore_name!r} is not a weight of this {self.model_type} model ({self.dims.layers} layers)"
            )
        return tuple(f"{self.prefix}model.layers.{m.group(1)}.{s}" for s in self._map_for(layer)[m.group(2)])

    @property
    def embedding_hf_name(self) -> str:
        """The HF name of the input embedding (``model.embed_tokens.weight``, prefixed)."""
        return self.prefix + GLOBAL_MAP[EMBEDDING]

    @property
    def lm_head_hf_name(self) -> str:
        """The HF name of the output layer (``lm_head.weight``, prefixed), also when tied."""
        return self.prefix + GLOBAL_MAP[OUTPUT]

    def is_carried(self, hf_name: str) -> bool:
        """Whether ``hf_name`` is carried through untouched (a vision-language family's vision
        tower or projector): not a weight of the language model, never converted or trained."""
        return bool(self.carried) and hf_name.startswith(self.carried)

    def hf_names(self) -> list[str]:
        """Every HF weight name, in model order (``lm_head.weight`` only when untied)."""
        return [h for n in self.mcore_names() for h in self.hf_sources(n)]

    # ----------------------------------------------------------------- conversion

    def _qkv_rows(self) -> list[int]:
        d = self.dims
        return [d.heads // d.kv_heads * d.head_dim, d.head_dim, d.head_dim]

    def mcore_to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs for the full Megatron tensor ``name`` (global layer
        number, either spelling). Returns ``[]`` for the tied copy of the embedding. Outputs
        are views of ``tensor`` where possible, else new contiguous tensors; dtype unchanged.
        Raises KeyError for an unknown name, WeightsMismatchError for a wrong shape.
        """
        canon = canonical_name(name)
        if canon == OUTPUT and self.dims.tied:
            return []
        sources = self.hf_sources(canon)
        self._check_shape(canon, tuple(tensor.shape), self._mcore_dims(canon))
        if canon in (EMBEDDING, OUTPUT):
            return [(sources[0], tensor[: self.dims.vocab])]
        if canon.endswith("linear_qkv.weight") or canon.endswith("linear_qkv.bias"):
            groups = tensor.reshape(self.dims.kv_heads, -1, *tensor.shape[1:])
            parts = groups.split(self._qkv_rows(), dim=1)
            return [(s, p.reshape(-1, *tensor.shape[1:])) for s, p in zip(sources, parts)]
        if canon.endswith("linear_fc1.weight"):
            return list(zip(sources, tensor.chunk(2, dim=0)))
        return [(sources[0], tensor)]

    def hf_to_mcore_tensor(self, name: str, hf_state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full Megatron tensor ``name`` built from its HF sources in ``hf_state`` (only
        those are read, so a lazy mapping over files streams). Vocabulary padding rows are
        zeros; the dtype is the sources' (they must agree)."""
        sources = self.hf_sources(name)
        parts = [hf_state[s] for s in sources]
        for s, p in zip(sources, parts):
            self._check_shape(s, tuple(p.shape), self._hf_dims(s))
        if len({p.dtype for p in parts}) > 1:
            raise ValueError(
                f"{name}: its HF tensors {sources} have different dtypes {[str(p.dtype) for p in parts]}"
            )
        canon = canonical_name(name)
        if canon in (EMBEDDING, OUTPUT):
            out = parts[0].new_zeros((self.dims.padded_vocab, *parts[0].shape[1:]))
            out[: self.dims.vocab] = parts[0]
            return out
        if canon.endswith("linear_qkv.weight") or canon.endswith("linear_qkv.bias"):
            g = self.dims.kv_heads
            rest = parts[0].shape[1:]
            groups = [p.reshape(g, -1, *rest) for p in parts]
            return torch.cat(groups, dim=1).reshape(-1, *rest)
        if canon.endswith("linear_fc1.weight"):
            return torch.cat(parts, dim=0)
        return parts[0]

    def hf_to_mcore(
        self, hf_state: Mapping[str, torch.Tensor], names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Megatron tensors (canonical names, default: all of :meth:`mcore_names`) from an HF
        state dict. Raises KeyError naming a missing HF tensor."""
        return {
            n: self.hf_to_mcore_tensor(n, hf_state) for n in (self.mcore_names() if names is None else names)
        }

    # ----------------------------------------------------------------- shapes and checks

    def _dims_table(self) -> dict[str, _Dim]:
        d = self.dims
        derived = "" if d.head_dim_explicit else " (head_dim = hidden_size / num_attention_heads)"
        heads_fields = "num_attention_heads / head_dim"
        kv_fields = "num_key_value_heads / head_dim" + (
            "" if d.head_dim_explicit else " / num_attention_heads"
        )
        return {
            "h": _Dim(d.hidden, "hidden_size", f"hidden_size={d.hidden}"),
            "f": _Dim(d.ffn, "intermediate_size", f"intermediate_size={d.ffn}"),
            "2f": _Dim(2 * d.ffn, "intermediate_size", f"2 x intermediate_size={d.ffn} = {2 * d.ffn}"),
            "V": _Dim(d.vocab, "vocab_size", f"vocab_size={d.vocab}"),
            "Vp": _Dim(d.padded_vocab, "vocab_size", f"vocab_size={d.vocab} padded to {d.padded_vocab}"),
            "q": _Dim(
                d.heads * d.head_dim,
                heads_fields,
                f"num_attention_heads={d.heads} x head_dim={d.head_dim}{derived} = {d.heads * d.head_dim}",
            ),
            "kv": _Dim(
                d.kv_heads * d.head_dim,
                kv_fields,
                f"num_key_value_heads={d.kv_heads} x head_dim={d.head_dim}{derived} = "
                f"{d.kv_heads * d.head_dim}",
            ),
            "d": _Dim(d.head_dim, "head_dim", f"head_dim={d.head_dim}{derived}"),
            "E": _Dim(d.experts, "num_experts", f"num_experts={d.experts}"),
            "m": _Dim(d.moe_ffn, d.moe_ffn_field, f"{d.moe_ffn_field}={d.moe_ffn}"),
            "2m": _Dim(
                2 * d.moe_ffn, d.moe_ffn_field, f"2 x {d.moe_ffn_field}={d.moe_ffn} = {2 * d.moe_ffn}"
            ),
            **self._mla_dims(),
            "s": _Dim(
                d.shared_ffn,
                "n_shared_experts / moe_intermediate_size",
                f"shared experts {d.shared_ffn} wide",
            ),
            "2s": _Dim(
                2 * d.shared_ffn,
                "n_shared_experts / moe_intermediate_size",
                f"2 x shared experts' width {d.shared_ffn} = {2 * d.shared_ffn}",
            ),
            "qkv": _Dim(
                (d.heads + 2 * d.kv_heads) * d.head_dim,
                "num_attention_heads / num_key_value_heads / head_dim",
                f"(num_attention_heads={d.heads} + 2 x num_key_value_heads="
                f"{d.kv_heads}) x head_dim={d.head_dim}{derived} = "
                f"{(d.heads + 2 * d.kv_heads) * d.head_dim}",
            ),
        }

    def _mla_dims(self) -> dict[str, _Dim]:
        """The multi-latent attention's dimensions (none for grouped-query attention)."""
        mla, n = self.dims.mla, self.dims.heads
        if mla is None:
            return {}
        q_head, kv_head = mla.qk_nope + mla.qk_rope, mla.qk_nope + mla.v_dim
        heads = f"num_attention_heads={n}"
        return {
            "ql": _Dim(mla.q_lora_rank or 0, "q_lora_rank", f"q_lora_rank={mla.q_lora_rank}"),
            "kvl": _Dim(mla.kv_lora_rank, "kv_lora_rank", f"kv_lora_rank={mla.kv_lora_rank}"),
            "kvd": _Dim(
                mla.kv_lora_rank + mla.qk_rope,
                "kv_lora_rank / qk_rope_head_dim",
                f"kv_lora_rank={mla.kv_lora_rank} + qk_rope_head_dim={mla.qk_rope} = {mla.kv_lora_rank + mla.qk_rope}",
            ),
            "qup": _Dim(
                n * q_head,
                "num_attention_heads / qk_nope_head_dim / qk_rope_head_dim",
                f"{heads} x (qk_nope_head_dim={mla.qk_nope} + qk_rope_head_dim={mla.qk_rope}) = {n * q_head}",
            ),
            "kvup": _Dim(
                n * kv_head,
                "num_attention_heads / qk_nope_head_dim / v_head_dim",
                f"{heads} x (qk_nope_head_dim={mla.qk_nope} + v_head_dim={mla.v_dim}) = {n * kv_head}",
            ),
            "ov": _Dim(
                n * mla.v_dim,
                "num_attention_heads / v_head_dim",
                f"{heads} x v_head_dim={mla.v_dim} = {n * mla.v_dim}",
            ),
        }

    _HF_SHAPES: ClassVar[dict[str, tuple[str, ...]]] = HF_SHAPES
    _MCORE_SHAPES: ClassVar[dict[str, tuple[str, ...]]] = MCORE_SHAPES

    def _hf_dims(self, hf_name: str) -> tuple[_Dim, ...]:
        hf_name = hf_name.removeprefix(self.prefix)
        m = HF_LAYER.match(hf_name)
        key = EXPERT_NUMBER.sub("E", m.group(2)) if m else hf_name
        table = self._dims_table()
        return tuple(table[k] for k in self._HF_SHAPES[key])

    def _mcore_dims(self, name: str) -> tuple[_Dim, ...]:
        m = MCORE_LAYER.match(name)
        key = EXPERT_NUMBER.sub("E", m.group(2)) if m else name
        table = self._dims_table()
        return tuple(table[k] for k in self._MCORE_SHAPES[key])

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape, for every weight of :meth:`hf_names`."""
        return {n: tuple(x.size for x in self._hf_dims(n)) for n in self.hf_names()}

    def expected_mcore_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical Megatron name -> full shape, for every weight of :meth:`mcore_names`."""
        return {n: tuple(x.size for x in self._mcore_dims(n)) for n in self.mcore_names()}

    @staticmethod
    def _check_shape(name: str, actual: tuple[int, ...], dims: tuple[_Dim, ...]) -> None:
        if len(actual) != len(dims):
            raise WeightsMismatchError(
                dims[0].fields, f"{name} has shape {list(actual)}, expected {len(dims)} dimensions"
            )
        for i, (size, dim) in enumerate(zip(actual, dims)):
            if size != dim.size:
                raise WeightsMismatchError(
                    dim.fields,
                    f"the config gives {dim.how} for dimension {i} of {name}, but "
                    f"the weights have shape {list(actual)}",
                )

    def check_hf_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise :class:`WeightsMismatchError` naming the config field when the HF weights
        (name -> shape) are not those of this config: layer count, tied embeddings, biases,
        then every shape (hidden and vocabulary first, so the root cause is named).

        A tied config may come with an ``lm_head.weight`` (some checkpoints store the copy):
        it is not an error here, and the caller must check it equals the embedding. Carried
        tensors (:meth:`is_carried`) are not checked.
        """
        names = {n for n in shapes if not n.endswith(IGNORED_HF_SUFFIXES) and not self.is_carried(n)}
        outside = sorted(n for n in names if not n.startswith(self.prefix))
        if outside:  # only a vision-language family has a prefix to be outside of
            raise WeightsMismatchError(
                "model_type",
                f"a {self.model_type} model's tensors sit under {self.prefix!r} or "
                f"{' / '.join(repr(c) for c in self.carried)}, but the weights have {outside[:3]}",
            )
        names = {n.removeprefix(self.prefix) for n in names}
        shapes = {n.removeprefix(self.prefix): s for n, s in shapes.items()}
        layers = {int(m.group(1)) for n in names if (m := HF_LAYER.match(n))}
        self._check_layers(layers, "model.layers")
        if self.dims.tied:
            names.discard("lm_head.weight")
        elif "lm_head.weight" not in names:
            raise WeightsMismatchError(
                "tie_word_embeddings",
                "the config says false, but the weights have no lm_head.weight (are they tied?)",
            )
        self._check_bias(any(n.endswith("q_proj.bias") for n in names), "q_proj.bias")
        self._check_experts(names, HF_EXPERT)
        self._check_names(names, {n.removeprefix(self.prefix) for n in self.hf_names()}, "HF")
        for name in sorted(names, key=_priority):
            self._check_shape(name, tuple(shapes[name]), self._hf_dims(name))

    def check_mcore_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Like :meth:`check_hf_weights` for full Megatron tensors (canonical or local names,
        global layers). The padded vocabulary is the converter's ``dims.padded_vocab``."""
        names = {canonical_name(n) for n in shapes}
        shapes = {canonical_name(n): s for n, s in shapes.items()}
        layers = {int(m.group(1)) for n in names if (m := MCORE_LAYER.match(n))}
        self._check_layers(layers, "decoder.layers")
        if (OUTPUT in names) == self.dims.tied:
            raise WeightsMismatchError(
                "tie_word_embeddings",
                f"the config says {str(self.dims.tied).lower()}, but the "
                f"checkpoint {'has' if OUTPUT in names else 'has no'} a separate {OUTPUT}",
            )
        self._check_bias(any(n.endswith("linear_qkv.bias") for n in names), "linear_qkv.bias")
        self._check_experts(names, MCORE_EXPERT)
        self._check_names(names, set(self.mcore_names()), "Megatron")
        for name in sorted(names, key=_priority):
            self._check_shape(name, tuple(shapes[name]), self._mcore_dims(name))

    def _check_layers(self, layers: set[int], prefix: str) -> None:
        if layers != set(range(self.dims.layers)):
            found = f"{len(layers)} ({prefix}.{min(layers)}..{max(layers)})" if layers else "none"
            raise WeightsMismatchError(
                "num_hidden_layers", f"the config has {self.dims.layers} layers, the weights have {found}"
            )

    def _check_experts(self, names: set[str], pattern: re.Pattern[str]) -> None:
        """The expert numbers in ``names`` must be ``0 .. num_experts - 1`` (none if dense)."""
        found = {int(m.group(1)) for n in names if (m := pattern.search(n))}
        if found != set(range(self.dims.experts)):
            have = f"experts {min(found)}..{max(found)} ({len(found)})" if found else "no experts"
            raise WeightsMismatchError(
                "num_experts", f"the config has {self.dims.experts} experts a layer, the weights have {have}"
            )

    def _check_bias(self, present: bool, what: str) -> None:
        if present != self.qkv_bias:
            has = "has q/k/v biases" if self.qkv_bias else "has no q/k/v biases"
            found = "none" if self.qkv_bias else what
            raise WeightsMismatchError(
                "model_type", f"{self.model_type!r} {has}, but the weights have {found}"
            )

    @staticmethod
    def _check_names(names: set[str], expected: set[str], side: str) -> None:
        missing, unexpected = sorted(expected - names), sorted(names - expected)
        if missing or unexpected:
            raise WeightsMismatchError(
                "model_type",
                f"the {side} weights are not those of this architecture: missing "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}",
            )


def _priority(name: str) -> tuple[int, str]:
    """Check order: embedding / output first (vocab, hidden), norms, MLP, then attention, so
    that a wrong hidden_size is reported as such and not as a head count."""
    order = ("embed", "lm_head", "output_layer", "norm", "mlp", "")
    return next(i for i, key in enumerate(order) if key in name), name


class LlamaConverter(HFConverter):
    """Llama 2/3 (``LlamaForCausalLM``): no linear biases; RoPE scaling lives in the config."""

    model_type = "llama"


class MistralConverter(HFConverter):
    """Mistral (``MistralForCausalLM``): Llama's tensors; head_dim may differ from h / n."""

    model_type = "mistral"


class Qwen2Converter(HFConverter):
    """Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's tensors plus q/k/v biases."""

    model_type = "qwen2"
    qkv_bias = True


class Qwen3Converter(HFConverter):
    """Qwen3 dense (``Qwen3ForCausalLM``): Llama's tensors plus per-head q/k RMSNorms, no biases;
    head_dim (128 in the released models) is usually not hidden_size / num_attention_heads."""

    model_type = "qwen3"
    qk_norm = True


class Qwen3MoeConverter(HFConverter):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, and in every layer a softmax
    router over ``num_experts`` SwiGLU experts (no shared expert) instead of the dense MLP."""

    model_type = "qwen3_moe"
    qk_norm = True
    moe = True


class MixtralConverter(HFConverter):
    """Mixtral (``MixtralForCausalLM``): Mistral's attention, and in every layer a softmax router
    over ``num_local_experts`` SwiGLU experts of width ``intermediate_size``, the top-k
    renormalised; its files keep the original ``block_sparse_moe.experts.e.w1/w3/w2`` names."""

    model_type = "mixtral"
    moe = True
    moe_map = MIXTRAL_MOE_MAP


class DeepseekV3Converter(HFConverter):
    """DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention, ``first_k_dense_replace``
    dense layers, then MoE layers of a sigmoid router with a score-correction bias (Megatron's
    ``expert_bias`` buffer), ``n_routed_experts`` experts and ``n_shared_experts`` shared ones.
    Qwen3-MoE's expert names."""

    model_type = "deepseek_v3"
    moe = True
    expert_bias = True
    _HF_SHAPES: ClassVar[dict[str, tuple[str, ...]]] = DEEPSEEK_V3_HF_SHAPES
    _MCORE_SHAPES: ClassVar[dict[str, tuple[str, ...]]] = DEEPSEEK_V3_MCORE_SHAPES


class Mistral3Converter(HFConverter):
    """Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.x, Magistral Small 1.x):
    a Mistral language model (``text_config``) whose tensors sit under ``language_model.`` in the
    files, beside a Pixtral vision tower and a projector that are carried through untouched."""

    model_type = "mistral3"
    prefix = TEXT_PREFIXES["mistral3"]
    carried = CARRIED_PREFIXES["mistral3"]


CONVERTERS: dict[str, type[HFConverter]] = {
    c.model_type: c
    for c in (
        LlamaConverter,
        MistralConverter,
        Qwen2Converter,
        Qwen3Converter,
        Qwen3MoeConverter,
        MixtralConverter,
        Mistral3Converter,
        DeepseekV3Converter,
    )
}
