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
      carried.safetensors     a vision-language model's vision tower and projector (Mistral3):
                              not converted, never trained, the HF tensors bit for bit

:func:`mcore_to_hf` also reads a bare dist-checkpoint folder (``save_model_checkpoint``'s
output, or the ``dist/`` folder of a training checkpoint), given the HF config to export with.

Memory and streaming:

- HF -> Megatron: the HF files are read one tensor at a time (memory-mapped), but the Megatron
  side cannot stream: ``dist_checkpointing.save`` writes each rank's whole state dict in one
  collective call, so every rank holds its shard of the model (the model built at the given
  TP x PP, weights in the chosen dtype) until the save. Across ranks that is one copy of the
  model; with ``torchrun`` over several machines it is spread over them.
- A vision-language model: only its language model is a Megatron model; the carried tensors are
  copied into ``carried.safetensors`` and written back unchanged on export (never cast by
  ``--dtype``), after the language model's.
- Megatron -> HF: streams on both sides. No model is built: the checkpoint is read one layer at a
  time (``dist_checkpointing.load`` of that layer's slice of each stacked tensor, in one process,
  whatever layout wrote it) and HF shards are written as they fill, so peak memory is about one
  layer plus one output shard (and the embedding, read whole).

Refusals (:mod:`megatron_rl.errors` kinds; the CLI prints one line and exits with their code):
an output that is, holds or lies inside an input, or exists without ``overwrite``
(:class:`OutputError`, before anything is read); ``tensor_parallel`` / ``pipeline_parallel``
that do not divide what the config splits (:class:`UsageError`, before any rank starts); a
config.json that does not describe the weights or itself (:class:`~megatron_rl.convert.checks.ConfigMismatchError`,
an :class:`InputError` and a :class:`~megatron_rl.hf.layout.WeightsMismatchError` naming the
file and field); a truncated or corrupt safetensors file or Megatron shard (:class:`InputError`
naming the file); a tensor holding NaN or Inf (:class:`InputError` naming it, unless
``allow_nonfinite``). Outputs appear atomically (a temporary folder renamed into place), so a
refusal leaves no output behind and the inputs are only ever read.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from megatron_rl.convert.checks import (
    ConfigMismatchError,
    check_dist_files,
    check_output,
    check_parallel_sizes,
    config_errors,
    dist_read_error,
    nonfinite_problem,
    overflow_problem,
    read_config_json,
    refuse_or_warn,
    same_bits,
    show_progress,
    stage,
)
from megatron_rl.convert.ranks import group_rank, quiet_megatron_warnings, run_on_ranks
from megatron_rl.errors import InputError, UsageError
from megatron_rl.fileio import atomic_output_dir
from megatron_rl.hf.arch import (
    language_model_config,
    language_model_dict,
    mla_settings,
    moe_settings,
    padded_vocab_size,
    rope_parameters,
)
from megatron_rl.hf.files import (
    CARRIED_FILE,
    HFWeights,
    ShardWriter,
    carried_tensors,
    copy_side_files,
    dtype_name,
    parse_dtype,
    parse_size,
    write_carried,
)
from megatron_rl.hf.layout import HFConverter, WeightsMismatchError, canonical_name
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
_STORED_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")  # a layer stored on its own
_LAYER_NUMBER = re.compile(r"^decoder\.layers\.(\d+)\.")
FORMAT, FORMAT_VERSION = "megatron-rl/mcore-model", 1


# --------------------------------------------------------------------------- configs


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
    :class:`~megatron_rl.convert.checks.ConfigMismatchError` naming config.json and the field on
    any mismatch, InputError naming a safetensors file that cannot be read.
    """
    hf_dir = Path(hf_dir)
    config = read_config_json(hf_dir, flag="--hf")
    with config_errors(hf_dir / "config.json"):
        converter = HFConverter.for_config(config_from_dict(config), tensor_parallel=tensor_parallel)
    weights = HFWeights(hf_dir)
    try:
        with config_errors(hf_dir / "config.json"):
            converter.check_hf_weights({n: weights.shape(n) for n in weights})
        head, embedding = converter.lm_head_hf_name, converter.embedding_hf_name
        if converter.dims.tied and head in weights:
            if not same_bits(weights[head], weights[embedding]):
                raise ConfigMismatchError(
                    hf_dir / "config.json",
                    "tie_word_embeddings",
                    f"the config ties lm_head to the embedding, but {head} differs from it",
                )
        dtypes = {n: weights.dtype(n) for n in converter.hf_names()}
        matrices = {n for n in dtypes if len(weights.shape(n)) > 1}
    finally:
        weights.close()
    if any(not d.is_floating_point for d in dtypes.values()):
        name = next(n for n, d in dtypes.items() if not d.is_floating_point)
        raise InputError(
            f"{hf_dir}: tensor {name} is {dtype_name(dtypes[name])}; only floating-point weights convert"
        )
    chosen = parse_dtype(dtype)
    if chosen is None:
        chosen = dtypes[converter.embedding_hf_name]
        odd = {n: dtype_name(d) for n, d in dtypes.items() if d != chosen and n in matrices}
        if odd:
            raise UsageError(
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


def hf_to_mcore(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    dtype: str = "keep",
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Convert the HF model folder ``hf_dir`` into the Megatron format at ``out_dir``.

    The model is built at ``tensor_parallel x pipeline_parallel`` (which checks the layout fits
    the config), filled from the HF weights and saved with ``dist_checkpointing``; the result
    loads at any layout with the same padded vocabulary. The ranks come from
    :func:`~megatron_rl.convert.ranks.run_on_ranks`: the caller's group of several ranks
    (``torchrun``: every rank must call this), else that many local CPU processes (gloo).
    Everything that can be checked from the config, the file headers and the paths is checked
    here, before any rank starts. A tensor holding NaN or Inf is refused (InputError naming it)
    unless ``allow_nonfinite``. ``progress``: one line per stage on stderr and a progress bar
    (None: when stderr is a terminal). Returns ``out_dir``.
    """
    out = Path(out_dir).absolute()
    check_output(out, [hf_dir], overwrite=overwrite)
    config = read_config_json(hf_dir, flag="--hf")
    check_parallel_sizes(
        language_model_dict(config),
        Path(hf_dir) / "config.json",
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
    )
    plan = plan_hf_to_mcore(hf_dir, tensor_parallel=tensor_parallel, dtype=dtype)  # fail early, here
    show = show_progress(progress) and group_rank() == 0  # under torchrun, rank 0 speaks for all
    stage(
        show,
        f"{hf_dir}: {plan.converter.model_type}, {plan.converter.dims.layers} layers, "
        f"{len(plan.converter.hf_names())} tensors, checked for TP={tensor_parallel} PP={pipeline_parallel}",
    )
    args = (
        str(hf_dir),
        str(out),
        tensor_parallel,
        pipeline_parallel,
        dtype,
        overwrite,
        allow_nonfinite,
        show,
    )
    world = tensor_parallel * pipeline_parallel
    with quiet_megatron_warnings():
        run_on_ranks(world, _write_mcore_in_group, args, announce=lambda line: stage(show, line))
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


def _write_mcore_in_group(
    hf_dir: str,
    out_dir: str,
    tp: int,
    pp: int,
    dtype: str,
    overwrite: bool,
    allow_nonfinite: bool,
    show: bool,
) -> None:
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
            stage(show and rank0, f"building the model at TP={tp} PP={pp} and reading the HF weights")
            chunk, bad_source = _filled_chunk(plan, tp, pp, show=show)
            # Every rank learns of a non-finite tensor on any rank before the collective save.
            problems: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(problems, bad_source or _nonfinite_in_chunk(chunk, plan, dtype))
            refuse_or_warn(next((p for p in problems if p), None), allow_nonfinite, warn=rank0)
            stage(show and rank0, "saving the Megatron checkpoint (dist_checkpointing)")
            save_model_checkpoint(chunk, tmp / MODEL_DIR)
            del chunk
            dist.barrier()
            if rank0:
                _write_meta(tmp, plan, tp, pp)
                if plan.converter.carried:
                    stage(show, f"carrying the {' / '.join(plan.converter.carried)} tensors unchanged")
                    write_carried(tmp / CARRIED_FILE, carried_tensors(plan.hf_dir, plan.converter.carried))
        dist.barrier()  # no rank returns before the output is in place


def _nonfinite_in_chunk(chunk: GPTModel, plan: HFPlan, dtype: str) -> str | None:
    """The first weight of this rank holding NaN/Inf after the cast to the model's dtype (the HF
    tensors were finite: an fp16 overflow), or None."""
    names = chunk_global_names(chunk)
    for local, param in chunk.named_parameters():
        problem = nonfinite_problem(
            names.get(local, local), param.detach(), f"{plan.hf_dir} cast to --dtype {dtype}"
        )
        if problem is not None:
            return problem
    return None


def _filled_chunk(plan: HFPlan, tp: int, pp: int, *, show: bool) -> tuple[GPTModel, str | None]:
    """This rank's GPTModel at TP x PP, weights from the HF files (no random initialisation),
    and the refusal naming the first HF tensor it read that holds NaN or Inf (or None)."""
    from megatron.core import (
        parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    with config_errors(plan.hf_dir / "config.json"):
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
        disable=not (show and dist.get_rank() == 0),
    )
    reads = _CountedReads(weights, bar)
    try:
        load_hf_into_chunk(
            chunk,
            plan.converter,
            reads,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=tp,
        )
    finally:
        bar.close()
        weights.close()
    return chunk, reads.nonfinite


class _CountedReads(Mapping[str, torch.Tensor]):
    """``weights`` as a mapping that advances ``bar`` by each tensor's bytes as it is read, shows
    how many tensors have been read, and keeps (``nonfinite``) the refusal for the first one
    that holds NaN or Inf: the ranks agree on it before the save, so none raises alone."""

    def __init__(self, weights: HFWeights, bar: tqdm):
        self._weights, self._bar, self._count = weights, bar, 0
        self.nonfinite: str | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._weights[name]
        if self.nonfinite is None:
            self.nonfinite = nonfinite_problem(name, t, str(self._weights.file_of(name)))
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
        if not path.is_dir():
            raise InputError(f"--mcore {path}: no such folder")
        if (path / META_FILE).is_file():
            self.meta = _read_meta(path / META_FILE)
            self.dist_dir = path / MODEL_DIR
        elif (path / "dist" / ".metadata").is_file():
            self.dist_dir = path / "dist"
        else:
            self.dist_dir = path
        if not (self.dist_dir / ".metadata").is_file():
            raise InputError(
                f"--mcore {path}: neither a converted checkpoint ({META_FILE}) nor "
                "a dist_checkpointing folder (.metadata)"
            )
        self.side_dir = path / HF_FILES_DIR if self.meta else None
        carried = self.dist_dir.parent / CARRIED_FILE  # beside model/ (converted) or dist/ (a run's)
        self.carried_file: Path | None = carried if carried.is_file() else None
        check_dist_files(self.dist_dir)  # a missing or truncated shard, named before any read
        with _process_group():
            try:
                stored = dist_checkpointing.load_tensors_metadata(str(self.dist_dir))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 -- many types on a bad folder
                raise dist_read_error(self.dist_dir, (), e) from None
        self._stored = {
            k: (tuple(v.global_shape), v.dtype) for k, v in stored.items() if not k.startswith("optimizer.")
        }  # training checkpoints hold both
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._key_of: dict[str, str] = {}  # canonical name -> its stored key, where they differ
        self.dtypes: dict[str, torch.dtype] = {}
        for key, (shape, dtype) in self._stored.items():
            for name, sub in self._names(key, shape):
                self.shapes[name], self.dtypes[name] = sub, dtype
        layers = {int(m.group(1)) for n in self.shapes if (m := _LAYER_NUMBER.match(n))}
        self.num_layers = max(layers) + 1 if layers else 0

    def _names(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The per-layer (and per-expert) canonical names and shapes of a stored tensor.

        Layers of one structure are stored stacked (``decoder.layers.X [layers, ...]``); a model
        whose layers differ (DeepSeek-V3: dense and MoE layers, multi-latent attention) stores
        each layer on its own (``decoder.layers.i.X``), its experts stacked (``[experts, ...]``)."""
        if not key.startswith("decoder.layers."):
            return [(key, shape)]
        per_layer = _STORED_LAYER.match(key)
        if per_layer is not None:
            i, rest = per_layer.group(1), per_layer.group(2)
            if rest.startswith(_EXPERTS_KEY):
                leaf = rest.removeprefix(_EXPERTS_KEY)
                return [(f"decoder.layers.{i}.{_EXPERT_NAME}{e}.{leaf}", shape[1:]) for e in range(shape[0])]
            name = canonical_name(key)  # the local spec's norm names, as the converter spells them
            if name != key:
                self._key_of[name] = key
            return [(name, shape)]
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
        own = None if m is None else f"decoder.layers.{m.group(1)}.{_EXPERTS_KEY}{m.group(3)}"
        if m and own in self._stored:  # a layer stored on its own: a (1, ...) slice of its experts
            shape, dtype = self._stored[own]
            data = torch.empty((1, *shape[1:]), dtype=dtype)
            return ShardedTensor.from_rank_offsets(own, data, (0, int(m.group(2)), shape[0]), replica_id=0)
        stored = self._key_of.get(name, name)
        if stored in self._stored:  # a layer stored on its own, or a tensor outside the layers
            shape, dtype = self._stored[stored]
            return ShardedTensor.from_rank_offsets(stored, torch.empty(shape, dtype=dtype), replica_id=0)
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
            try:
                loaded = dist_checkpointing.load(request, str(self.dist_dir), validate_access_integrity=False)
            # torch's checkpoint reader wraps every cause in a CheckpointException (a BaseException).
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                raise dist_read_error(self.dist_dir, {r.key for r in request.values()}, e) from None
        out = {}
        for n in names:  # a training checkpoint's common state comes back too: not asked for
            t, key = loaded[n], request[n].key
            if key == self._key_of.get(n, n):  # stored whole
                pass
            elif _EXPERT_PARAM.match(n):
                t = t[0] if _STORED_LAYER.match(key) else t[0, 0]  # one layer's experts, or the stack
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


def _read_meta(path: Path) -> dict[str, JsonValue]:
    """The metadata file of an :func:`hf_to_mcore` output, checked; InputError naming it."""
    try:
        meta = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise InputError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} file")
    kinds = {"hf_config": dict, "padded_vocab_size": int, "hf_dtype": str, "hf_dtype_exceptions": dict}
    for field, kind in kinds.items():
        if not isinstance(meta.get(field), kind):
            raise InputError(f"{path}: {field}: expected a JSON {kind.__name__}, got {meta.get(field)!r}")
    return meta


def _export_config(ckpt: McoreCheckpoint, hf_config: str | os.PathLike[str] | None) -> dict[str, JsonValue]:
    """The config.json to export with: the given one (checked against the stored one when both
    exist) or the stored one. Raises ConfigMismatchError naming the file and a differing field."""
    given = read_config_json(hf_config, flag="--hf-config") if hf_config is not None else None
    stored = ckpt.meta["hf_config"] if ckpt.meta else None
    if given is not None and stored is not None:
        with config_errors(Path(cast(str, hf_config)) / "config.json"):
            check_same_architecture(stored, given)
    if given is not None:
        return given
    if stored is None:
        raise UsageError(
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
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"{ckpt.dist_dir.parent / META_FILE}: hf_dtype: {name!r} is not a torch dtype")
    return dtype


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
    allow_nonfinite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Export a Megatron checkpoint (see :class:`McoreCheckpoint`) as an HF model folder.

    ``dtype`` ``keep``: the HF dtypes recorded at conversion, or the stored dtypes for a bare
    checkpoint. ``hf_config`` (a folder with config.json; required for a bare checkpoint) gives
    the exported config.json and side files, after checking it describes the same architecture
    as the stored config. The paths, the config and every shard's length are checked before
    anything is written. Streams layer by layer; a tensor holding NaN or Inf (or overflowing
    ``dtype``) is refused, naming it, unless ``allow_nonfinite``. ``progress``: stage lines and a
    bar on stderr (None: when stderr is a terminal). Returns ``out_dir``.
    """
    check_output(out_dir, [mcore_dir, hf_config], overwrite=overwrite)
    out_dtype, shard_bytes = parse_dtype(dtype), parse_size(max_shard_size)
    show = show_progress(progress)
    with quiet_megatron_warnings(), _process_group():
        ckpt = McoreCheckpoint(mcore_dir)
        config = _export_config(ckpt, hf_config)
        source = (
            Path(hf_config) / "config.json" if hf_config is not None else ckpt.dist_dir.parent / META_FILE
        )
        with config_errors(source):
            hf = config_from_dict(config)
            converter = HFConverter.for_config(
                hf, padded_vocab=ckpt.padded_vocab(language_model_config(hf).vocab_size)
            )
            converter.check_mcore_weights(ckpt.shapes)
        stage(
            show,
            f"{mcore_dir}: {converter.model_type}, {converter.dims.layers} layers, "
            f"{len(converter.mcore_names())} tensors, checked against {source}; writing HF shards",
        )
        _write_hf(
            ckpt,
            converter,
            config,
            out_dir,
            out_dtype=out_dtype,
            shard_bytes=shard_bytes,
            hf_config=hf_config,
            overwrite=overwrite,
            allow_nonfinite=allow_nonfinite,
            show=show,
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
    allow_nonfinite: bool,
    show: bool,
) -> None:
    """Stream the checkpoint into HF shards, then config.json and the side files."""

    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        written: dict[str, torch.dtype] = {}
        names = converter.mcore_names()
        total = sum(math.prod(ckpt.shapes[n]) * ckpt.dtypes[n].itemsize for n in names)
        bar = tqdm(total=total, desc="mcore -> hf", unit="B", unit_scale=True, disable=not show)
        warned = False
        for group in _layer_groups(names):
            loaded = ckpt.read(group)
            for name in group:  # model order, whatever order the loader returns
                tensor = loaded.pop(name)
                hf_names = ", ".join(converter.hf_sources(name))
                problem = nonfinite_problem(f"{name} (HF {hf_names})", tensor, str(ckpt.dist_dir))
                for hf_name, t in converter.mcore_to_hf(name, tensor):
                    cast_t = t.to(_hf_dtype(ckpt, out_dtype, hf_name, tensor.dtype))
                    problem = problem or overflow_problem(hf_name, t, cast_t, str(ckpt.dist_dir))
                    writer.add(hf_name, cast_t)
                    written[hf_name] = cast_t.dtype
                refuse_or_warn(problem, allow_nonfinite, warn=not warned)
                warned = warned or problem is not None  # one warning line, not one per tensor
                bar.update(tensor.numel() * tensor.element_size())
            bar.set_postfix(tensors=len(written))
        bar.close()
        carried_from = ckpt.carried_file or hf_config
        if converter.carried:
            if carried_from is None:
                raise InputError(
                    f"{ckpt.dist_dir}: a {converter.model_type} checkpoint without its {CARRIED_FILE} "
                    "(the vision tower); give the HF folder it was made from (--hf-config)"
                )
            for hf_name, t in carried_tensors(carried_from, converter.carried):
                writer.add(hf_name, t)  # as stored: the vision tower is never cast
                written[hf_name] = t.dtype
        writer.close()
        config = dict(config, dtype=dtype_name(written[converter.embedding_hf_name]))
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for src in (ckpt.side_dir, hf_config):
            if src is not None and Path(src).is_dir():
                copy_side_files(src, tmp)
