"""Checkpoint conversion between Hugging Face (safetensors) and this project's Megatron format.

    hf_to_mcore("Qwen2.5-7B/", "qwen-mcore/", tensor_parallel=2, pipeline_parallel=1)
    mcore_to_hf("qwen-mcore/", "qwen-hf/", max_shard_size="5GB")
    mcore_to_hf("run/checkpoints/step_00000100/dist", "step100-hf/", hf_config="Qwen2.5-7B/")

The Megatron side (what :func:`hf_to_mcore` writes, :func:`mcore_to_hf` reads)::

    OUT/
      megatron_rl_model.json  format + version, the HF config.json (as a dict), the padded
                              vocabulary, the Megatron params dtype, the HF dtype of every tensor
                              (one dtype + exceptions), the TP/PP it was written at, versions
      model/                  megatron.core.dist_checkpointing of the GPTModel, exactly what
                              training/model.py's save_model_checkpoint writes: every tensor by
                              its global name and shape, layers stacked, any TP/PP loads it
      hf/                     tokenizer and generation_config files of the HF model, verbatim

:func:`mcore_to_hf` also reads a bare dist-checkpoint folder (``save_model_checkpoint``'s
output, or the ``dist/`` folder of a training checkpoint), given the HF config to export with.

Memory and streaming:

- HF -> Megatron: the HF files are read one tensor at a time (memory-mapped), but the Megatron
  side cannot stream: ``dist_checkpointing.save`` writes each rank's whole state dict in one
  collective call, so every rank holds its shard of the model (the model built at the given
  TP x PP, weights in the chosen dtype) until the save. Across ranks that is one copy of the
  model; with ``torchrun`` over several machines it is spread over them.
- Megatron -> HF: streams on both sides. No model is built: the checkpoint is read one layer at a
  time (``dist_checkpointing.load`` of that layer's slice of each stacked tensor, in one process,
  whatever layout wrote it) and HF shards are written as they fill, so peak memory is about one
  layer plus one output shard (and the embedding, read whole).

Every mismatch between a config and the weights raises
:class:`~megatron_rl.hf.layout.WeightsMismatchError` naming the config field; nothing is
written then. Outputs appear atomically (a temporary folder renamed into place).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rl.fileio import atomic_output_dir
from megatron_rl.hf.arch import moe_settings, padded_vocab_size, rope_parameters
from megatron_rl.hf.files import HFWeights, ShardWriter, copy_side_files, dtype_name, parse_dtype, parse_size
from megatron_rl.hf.layout import HFConverter, WeightsMismatchError
from megatron_rl.training.chunks import chunk_global_names, load_hf_into_chunk
from megatron_rl.training.cpu_compat import apply_cpu_compat
from megatron_rl.training.model import build_gpt_model, save_model_checkpoint, transformer_config_from_hf
from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy this name is Any.
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from transformers import PretrainedConfig

    from megatron_rl.fileio import JsonValue

__all__ = [
    "FORMAT",
    "HF_FILES_DIR",
    "META_FILE",
    "MODEL_DIR",
    "McoreCheckpoint",
    "check_output_dir",
    "check_same_architecture",
    "hf_to_mcore",
    "mcore_to_hf",
    "output_summary",
    "plan_hf_to_mcore",
]

META_FILE, MODEL_DIR, HF_FILES_DIR = "megatron_rl_model.json", "model", "hf"
# dist_checkpointing stores MoE experts (SequentialMLP) under one key per weight, stacked
# [layers, experts, ...]: "decoder.layers." + _EXPERTS_KEY + "linear_fc1.weight".
_EXPERTS_KEY, _EXPERT_NAME = "mlp.experts.experts.", "mlp.experts.local_experts."
_EXPERT_PARAM = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
FORMAT, FORMAT_VERSION = "megatron-rl/mcore-model", 1


# --------------------------------------------------------------------------- configs


def _read_config_dict(folder: str | os.PathLike[str]) -> dict[str, JsonValue]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    return json.loads(path.read_text())


def config_from_dict(config: dict[str, JsonValue]) -> PretrainedConfig:
    """A ``transformers`` config object from a config.json dict."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,  # lazy: transformers takes seconds to import; only this path needs it
    )

    if config.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"model_type: {config.get('model_type')!r} is not a transformers model")
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def _architecture(config: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """The config values that shape the weights or the computation, effective values filled in
    (head_dim, kv heads, RoPE parameters in either layout). Not compared: fields that change
    neither (token ids, max_position_embeddings, use_cache, dtype, ...)."""
    hf = config_from_dict(config)
    heads = hf.num_attention_heads
    window = getattr(hf, "sliding_window", None)
    if hf.model_type.startswith("qwen") and not getattr(hf, "use_sliding_window", False):
        window = None
    arch: dict[str, JsonValue] = {
        "model_type": hf.model_type,
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
        )
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


# --------------------------------------------------------------------------- HF -> Megatron


@dataclass
class HFPlan:
    """What :func:`hf_to_mcore` will do, checked before anything is built or written."""

    hf_dir: Path
    config: dict[str, JsonValue]  # config.json as read
    converter: HFConverter
    params_dtype: torch.dtype  # dtype of the Megatron model's weights
    hf_dtype: str  # the HF dtype this checkpoint stands for (for `--dtype keep` on export)
    hf_dtype_exceptions: dict[str, str]  # HF tensors whose dtype differs from hf_dtype


def plan_hf_to_mcore(hf_dir: str | os.PathLike, *, tensor_parallel: int = 1, dtype: str = "keep") -> HFPlan:
    """Read config.json and the safetensors headers of ``hf_dir`` and check they agree.

    ``dtype`` ``keep`` takes the embedding's dtype for the model and requires every weight
    matrix to share it (norms may differ: Megatron keeps its norms in fp32 anyway, and their
    HF dtypes are recorded so that an export with ``keep`` restores them). Raises
    WeightsMismatchError naming the config field on any mismatch.
    """
    hf_dir = Path(hf_dir)
    config = _read_config_dict(hf_dir)
    converter = HFConverter.for_config(config_from_dict(config), tensor_parallel=tensor_parallel)
    weights = HFWeights(hf_dir)
    try:
        converter.check_hf_weights({n: weights.shape(n) for n in weights})
        if converter.dims.tied and "lm_head.weight" in weights:
            if not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
                raise WeightsMismatchError(
                    "tie_word_embeddings",
                    "the config ties lm_head to the embedding, but lm_head.weight differs from it",
                )
        dtypes = {n: weights.dtype(n) for n in converter.hf_names()}
        matrices = {n for n in dtypes if len(weights.shape(n)) > 1}
    finally:
        weights.close()
    if any(not d.is_floating_point for d in dtypes.values()):
        raise ValueError(f"{hf_dir}: only floating-point weights can be converted")
    chosen = parse_dtype(dtype)
    if chosen is None:
        chosen = dtypes["model.embed_tokens.weight"]
        odd = {n: dtype_name(d) for n, d in dtypes.items() if d != chosen and n in matrices}
        if odd:
            raise ValueError(
                f"dtype: --dtype keep needs one dtype for the weight matrices; "
                f"the embedding is {dtype_name(chosen)} but {sorted(odd.items())[:3]}"
                f" ...; pass --dtype bf16|fp16|fp32"
            )
        exceptions = {n: dtype_name(d) for n, d in dtypes.items() if d != chosen}
    else:
        exceptions = {}
    return HFPlan(
        hf_dir=hf_dir,
        config=config,
        converter=converter,
        params_dtype=chosen,
        hf_dtype=dtype_name(chosen),
        hf_dtype_exceptions=exceptions,
    )


def check_output_dir(out_dir: str | os.PathLike, **inputs: str | os.PathLike | None) -> None:
    """Refuse an output folder that is one of the ``inputs`` folders, lies inside one, or holds
    one (``--overwrite`` would delete the input first); ValueError naming both (symlinks
    resolved). ``inputs``: option name (``hf_dir`` for ``--hf``) -> path, or None."""
    out = Path(out_dir).resolve()
    for name, path in inputs.items():
        if path is None:
            continue
        src = Path(path).resolve()
        flag = "--" + name.removesuffix("_dir").replace("_", "-")
        if out == src or out.is_relative_to(src) or src.is_relative_to(out):
            where = "is" if out == src else "lies inside" if out.is_relative_to(src) else "holds"
            raise ValueError(
                f"--out {out_dir} {where} the input {flag} {path}: writing there would destroy the "
                "input; choose an output folder outside it"
            )


def hf_to_mcore(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    dtype: str = "keep",
    overwrite: bool = False,
) -> Path:
    """Convert the HF model folder ``hf_dir`` into the Megatron format at ``out_dir``.

    The model is built at ``tensor_parallel x pipeline_parallel`` (which checks the layout fits
    the config), filled from the HF weights and saved with ``dist_checkpointing``; the result
    loads at any layout with the same padded vocabulary. Without a process group and with more
    than one model-parallel rank, that many local CPU processes are started (gloo); inside an
    initialised group (``torchrun``) every rank must call this. Returns ``out_dir``.
    """
    out = Path(out_dir).absolute()
    check_output_dir(out, hf_dir=hf_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; remove it or pass --overwrite")
    plan_hf_to_mcore(hf_dir, tensor_parallel=tensor_parallel, dtype=dtype)  # fail early, here
    args = (str(hf_dir), str(out), tensor_parallel, pipeline_parallel, dtype, overwrite)
    world = tensor_parallel * pipeline_parallel
    if world > 1 and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        _spawn(world, _write_mcore_in_group, args)
    else:
        _write_mcore_in_group(*args)
    return out


@contextlib.contextmanager
def _parallel_layout(tp: int, pp: int) -> Iterator[None]:
    """Megatron's parallel state at TP x PP: reused if already so, else set up and torn down."""
    from megatron.core import (
        parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp, None):
            raise ValueError(
                f"Megatron's parallel state is initialised at (TP, PP, VPP) = "
                f"{have}; conversion at TP={tp}, PP={pp} needs that layout or none"
            )
        yield
        return
    owned = not dist.is_initialized()
    init_parallel(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=0)
    try:
        yield
    finally:
        destroy_parallel(destroy_default_group=owned)


def _write_mcore_in_group(hf_dir: str, out_dir: str, tp: int, pp: int, dtype: str, overwrite: bool) -> None:
    """Every rank: build this rank's model chunk at TP x PP, fill it, save it collectively;
    rank 0 makes the temporary folder, writes the metadata and renames it into place."""

    with _parallel_layout(tp, pp):
        plan = plan_hf_to_mcore(hf_dir, tensor_parallel=tp, dtype=dtype)
        rank0 = dist.get_rank() == 0
        with atomic_output_dir(out_dir, overwrite=overwrite) if rank0 else contextlib.nullcontext() as tmp:
            box: list[str | None] = [str(tmp) if rank0 else None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:  # rank 0 always sends its folder
                raise RuntimeError("convert: rank 0 sent no output folder")
            tmp = Path(box[0])
            chunk = _filled_chunk(plan, tp, pp)
            save_model_checkpoint(chunk, tmp / MODEL_DIR)
            del chunk
            dist.barrier()
            if rank0:
                _write_meta(tmp, plan, tp, pp)
        dist.barrier()  # no rank returns before the output is in place


def _filled_chunk(plan: HFPlan, tp: int, pp: int) -> GPTModel:
    """This rank's GPTModel at TP x PP, weights from the HF files (no random initialisation)."""
    from megatron.core import (
        parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    hf_config = config_from_dict(plan.config)
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
    # perform_initialization=False: every weight is overwritten, so skip drawing random ones.
    config = transformer_config_from_hf(
        hf_config, parallel, params_dtype=plan.params_dtype, perform_initialization=False
    )
    chunk = build_gpt_model(hf_config, parallel, config=config, params_dtype=plan.params_dtype)
    weights = HFWeights(plan.hf_dir)
    # Rank 0's bar: the HF tensors its own stage reads (every stage reads its share alike).
    sources = [s for n in chunk_global_names(chunk).values() for s in plan.converter.hf_sources(n)]
    total = sum(math.prod(weights.shape(s)) * weights.dtype(s).itemsize for s in sources)
    bar = tqdm(
        total=total,
        desc="hf -> mcore",
        unit="B",
        unit_scale=True,
        disable=None if dist.get_rank() == 0 else True,
    )
    try:
        load_hf_into_chunk(
            chunk,
            plan.converter,
            _CountedReads(weights, bar),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=tp,
        )
    finally:
        bar.close()
        weights.close()
    return chunk


class _CountedReads(Mapping[str, torch.Tensor]):
    """``weights`` as a mapping that advances ``bar`` by each tensor's bytes as it is read, and
    shows how many tensors have been read."""

    def __init__(self, weights: Mapping[str, torch.Tensor], bar: tqdm):
        self._weights, self._bar, self._count = weights, bar, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._weights[name]
        self._count += 1
        self._bar.set_postfix(tensors=self._count, refresh=False)
        self._bar.update(t.numel() * t.element_size())
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def output_summary(path: str | os.PathLike) -> tuple[int, int]:
    """``(tensors, bytes)`` of what a conversion wrote at ``path``: an HF folder (its safetensors
    tensors) or an :func:`hf_to_mcore` output (its tensors per layer and expert, full shapes).
    Reads headers and metadata only."""
    path = Path(path)
    if (path / META_FILE).is_file():
        ckpt = McoreCheckpoint(path)
        return len(ckpt.shapes), sum(math.prod(s) * ckpt.dtypes[n].itemsize for n, s in ckpt.shapes.items())
    weights = HFWeights(path)
    try:
        return len(weights), weights.nbytes()
    finally:
        weights.close()


def _versions() -> dict[str, str | None]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {n: version(n) for n in ("megatron-core", "torch", "transformers", "megatron-rl")}


def _write_meta(folder: Path, plan: HFPlan, tp: int, pp: int) -> None:
    (folder / HF_FILES_DIR).mkdir()
    side = copy_side_files(plan.hf_dir, folder / HF_FILES_DIR)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_type": plan.converter.model_type,
        "hf_config": plan.config,
        "padded_vocab_size": plan.converter.dims.padded_vocab,
        "params_dtype": dtype_name(plan.params_dtype),
        "hf_dtype": plan.hf_dtype,
        "hf_dtype_exceptions": plan.hf_dtype_exceptions,
        "written_at": {"tensor_parallel": tp, "pipeline_parallel": pp},
        "source": str(plan.hf_dir.absolute()),
        "side_files": side,
        "versions": _versions(),
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")


# --------------------------------------------------------------------------- Megatron -> HF


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A one-rank gloo group for dist_checkpointing (which asks for ranks), unless one exists."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "mcore_to_hf runs in one process; call it outside torchrun (it "
                "reads any layout's checkpoint without model-parallel ranks)"
            )
        yield
        return
    if not torch.cuda.is_available():
        apply_cpu_compat()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class McoreCheckpoint:
    """A Megatron model checkpoint read one layer at a time, without building a model.

    ``path`` is a :func:`hf_to_mcore` output folder (with its metadata) or a bare
    ``dist_checkpointing`` folder of a GPTModel (``save_model_checkpoint``'s output, or a
    training checkpoint's ``dist/``). ``shapes`` maps canonical per-layer names (as
    :class:`~megatron_rl.hf.layout.HFConverter` uses them) to full shapes.
    """

    def __init__(self, path: str | os.PathLike):
        from megatron.core import (
            dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        path = Path(path)
        self.meta: dict[str, JsonValue] | None = None
        if (path / META_FILE).is_file():
            self.meta = json.loads((path / META_FILE).read_text())
            if self.meta.get("format") != FORMAT or self.meta.get("version") != FORMAT_VERSION:
                raise ValueError(f"{path / META_FILE}: not a {FORMAT} v{FORMAT_VERSION} file")
            self.dist_dir = path / MODEL_DIR
        elif (path / "dist" / ".metadata").is_file():
            self.dist_dir = path / "dist"
        else:
            self.dist_dir = path
        if not (self.dist_dir / ".metadata").is_file():
            raise FileNotFoundError(
                f"{path}: neither a converted checkpoint ({META_FILE}) nor "
                "a dist_checkpointing folder (.metadata)"
            )
        self.side_dir = path / HF_FILES_DIR if self.meta else None
        with _process_group():
            stored = dist_checkpointing.load_tensors_metadata(str(self.dist_dir))
        self._stored = {
            k: (tuple(v.global_shape), v.dtype) for k, v in stored.items() if not k.startswith("optimizer.")
        }  # training checkpoints hold both
        self.num_layers = next(
            (s[0] for k, (s, _) in self._stored.items() if k.startswith("decoder.layers.")), 0
        )
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for key, (shape, dtype) in self._stored.items():
            for name, sub in self._names(key, shape):
                self.shapes[name], self.dtypes[name] = sub, dtype

    def _names(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The per-layer (and per-expert) canonical names and shapes of a stored tensor."""
        if not key.startswith("decoder.layers."):
            return [(key, shape)]
        suffix = key.removeprefix("decoder.layers.")
        if suffix.startswith(_EXPERTS_KEY):  # stacked [layers, experts, ...]
            rest = suffix.removeprefix(_EXPERTS_KEY)
            return [
                (f"decoder.layers.{i}.{_EXPERT_NAME}{e}.{rest}", shape[2:])
                for i in range(shape[0])
                for e in range(shape[1])
            ]
        return [(f"decoder.layers.{i}.{suffix}", shape[1:]) for i in range(shape[0])]

    def _request(self, name: str) -> ShardedTensor:
        """A ShardedTensor asking for the stored slice that is canonical tensor ``name``."""
        from megatron.core.dist_checkpointing import (
            ShardedTensor,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        m = _EXPERT_PARAM.match(name)
        if m:  # a (1, 1, ...) slice of the [layers, experts, ...] stack
            i, e = int(m.group(1)), int(m.group(2))
            key = f"decoder.layers.{_EXPERTS_KEY}{m.group(3)}"
            shape, dtype = self._stored[key]
            data = torch.empty((1, 1, *shape[2:]), dtype=dtype)
            return ShardedTensor.from_rank_offsets(
                key, data, (0, i, shape[0]), (1, e, shape[1]), replica_id=0
            )
        parts = name.split(".")
        if name.startswith("decoder.layers.") and parts[2].isdigit():
            i, key = int(parts[2]), "decoder.layers." + ".".join(parts[3:])
            shape, dtype = self._stored[key]
            # A (1, ...) slice of the layer-stacked tensor: a plain (non-prepended)
            # ShardedTensor, which dist_checkpointing reads partially in one process.
            data = torch.empty((1, *shape[1:]), dtype=dtype)
            return ShardedTensor.from_rank_offsets(key, data, (0, i, shape[0]), replica_id=0)
        shape, dtype = self._stored[name]
        return ShardedTensor.from_rank_offsets(name, torch.empty(shape, dtype=dtype), replica_id=0)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Load the canonical ``names`` (any mix of layers) from the checkpoint."""
        from megatron.core import (
            dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        request = {name: self._request(name) for name in names}
        with _process_group():
            loaded = dist_checkpointing.load(request, str(self.dist_dir), validate_access_integrity=False)
        out = {}
        for n, t in loaded.items():
            if _EXPERT_PARAM.match(n):
                t = t[0, 0]
            elif n.startswith("decoder.layers."):
                t = t[0]
            out[n] = t
        return out

    def padded_vocab(self, vocab_size: int) -> int:
        """Rows of the stored embedding, checked against ``vocab_size`` (names the field)."""
        rows = self.shapes["embedding.word_embeddings.weight"][0]
        if self.meta is not None:
            if rows != self.meta["padded_vocab_size"]:
                raise ValueError(
                    f"{self.dist_dir}: embedding has {rows} rows, the metadata "
                    f"says {self.meta['padded_vocab_size']}"
                )
            return rows
        # Bare checkpoint: rows must be Megatron's padding of vocab_size at some TP size.
        if rows not in {padded_vocab_size(vocab_size, tp) for tp in range(1, 65)}:
            raise WeightsMismatchError(
                "vocab_size",
                f"vocab_size={vocab_size} does not pad to "
                f"the checkpoint's {rows} embedding rows at any TP size",
            )
        return rows


def _export_config(ckpt: McoreCheckpoint, hf_config: str | os.PathLike[str] | None) -> dict[str, JsonValue]:
    """The config.json to export with: the given one (checked against the stored one when both
    exist) or the stored one. Raises WeightsMismatchError naming a differing field."""
    given = _read_config_dict(hf_config) if hf_config is not None else None
    stored = ckpt.meta["hf_config"] if ckpt.meta else None
    if given is not None and stored is not None:
        check_same_architecture(stored, given)
    if given is not None:
        return given
    if stored is None:
        raise ValueError(
            f"hf_config: {ckpt.dist_dir} is a bare dist checkpoint; give the HF "
            "config folder it was made from (--hf-config)"
        )
    return stored


def _hf_dtype(
    ckpt: McoreCheckpoint, out_dtype: torch.dtype | None, hf_name: str, stored: torch.dtype
) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    if ckpt.meta is None:
        return stored
    name = ckpt.meta["hf_dtype_exceptions"].get(hf_name, ckpt.meta["hf_dtype"])
    return getattr(torch, name)


def _layer_groups(names: list[str]) -> list[list[str]]:
    """Canonical names grouped for reading: the embedding, each layer, the rest."""
    groups: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        key = (
            parts[2]
            if n.startswith("decoder.layers.")
            else ("embedding" if n.startswith("embedding.") else "tail")
        )
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def mcore_to_hf(
    mcore_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config: str | os.PathLike | None = None,
    dtype: str = "keep",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> Path:
    """Export a Megatron checkpoint (see :class:`McoreCheckpoint`) as an HF model folder.

    ``dtype`` ``keep``: the HF dtypes recorded at conversion, or the stored dtypes for a bare
    checkpoint. ``hf_config`` (a folder with config.json; required for a bare checkpoint) gives
    the exported config.json and side files, after checking it describes the same architecture
    as the stored config. Streams layer by layer; returns ``out_dir``.
    """
    check_output_dir(out_dir, mcore_dir=mcore_dir, hf_config=hf_config)
    out_dtype, shard_bytes = parse_dtype(dtype), parse_size(max_shard_size)
    with _process_group():
        ckpt = McoreCheckpoint(mcore_dir)
        config = _export_config(ckpt, hf_config)
        hf = config_from_dict(config)
        converter = HFConverter.for_config(hf, padded_vocab=ckpt.padded_vocab(hf.vocab_size))
        converter.check_mcore_weights(ckpt.shapes)
        _write_hf(
            ckpt,
            converter,
            config,
            out_dir,
            out_dtype=out_dtype,
            shard_bytes=shard_bytes,
            hf_config=hf_config,
            overwrite=overwrite,
        )
    return Path(out_dir)


def _write_hf(
    ckpt: McoreCheckpoint,
    converter: HFConverter,
    config: dict[str, JsonValue],
    out_dir: str | os.PathLike,
    *,
    out_dtype: torch.dtype | None,
    shard_bytes: int,
    hf_config: str | os.PathLike | None,
    overwrite: bool,
) -> None:
    """Stream the checkpoint into HF shards, then config.json and the side files."""

    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        written: dict[str, torch.dtype] = {}
        names = converter.mcore_names()
        total = sum(math.prod(ckpt.shapes[n]) * ckpt.dtypes[n].itemsize for n in names)
        bar = tqdm(total=total, desc="mcore -> hf", unit="B", unit_scale=True, disable=None)
        for group in _layer_groups(names):
            loaded = ckpt.read(group)
            for name in group:  # model order, whatever order the loader returns
                tensor = loaded.pop(name)
                for hf_name, t in converter.mcore_to_hf(name, tensor):
                    t = t.to(_hf_dtype(ckpt, out_dtype, hf_name, tensor.dtype))
                    writer.add(hf_name, t)
                    written[hf_name] = t.dtype
                bar.update(tensor.numel() * tensor.element_size())
            bar.set_postfix(tensors=len(written))
        bar.close()
        writer.close()
        config = dict(config, dtype=dtype_name(written["model.embed_tokens.weight"]))
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for src in (ckpt.side_dir, hf_config):
            if src is not None and Path(src).is_dir():
                copy_side_files(src, tmp)


# --------------------------------------------------------------------------- local ranks


def _rank_entry(rank: int, world: int, init_file: str, errors, fn, args) -> None:
    # Conversion is I/O and copies: CPU ranks over gloo, whatever accelerators the machine has.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- reported to the parent, which raises
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _spawn(world: int, fn, args: tuple) -> None:
    """Run ``fn(*args)`` on ``world`` local processes in one gloo group; raise if any fails
    (then the others are stopped: a rank waiting in a collective would wait forever)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="megatron-rl-convert-")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world, init_file, errors, fn, args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        pending = {p.sentinel: p for p in procs}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                p = pending.pop(cast(int, sentinel))  # wait() returns what it was given: int sentinels
                p.join()
                if p.exitcode != 0:
                    reports = []
                    with contextlib.suppress(Exception):
                        reports.append(errors.get(timeout=5))
                    detail = "\n".join(f"rank {r}:\n{tb}" for r, tb in reports)
                    raise RuntimeError(f"a conversion rank exited with code {p.exitcode}\n{detail}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init_file)
