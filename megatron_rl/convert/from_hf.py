"""HF -> Megatron: a Hugging Face model folder converted into this project's Megatron format
(:mod:`megatron_rl.convert.checkpoint` describes the format, the memory each direction needs, and
the refusals).

    plan = plan_hf_to_mcore("Qwen2.5-7B/", tensor_parallel=2)   # checks only: config vs weights
    hf_to_mcore("Qwen2.5-7B/", "qwen-mcore/", tensor_parallel=2, pipeline_parallel=1)

:func:`plan_hf_to_mcore` reads config.json and the safetensors headers and checks they agree
before any rank starts. :func:`hf_to_mcore` then builds the model at ``TP x PP`` on that many
ranks (the caller's under ``torchrun``, else local gloo processes), fills every weight from the
HF files (no random initialisation), agrees over the ranks on any NaN or Inf, and saves with
``dist_checkpointing`` into a temporary folder that rank 0 completes with the metadata, the HF
side files and the carried tensors of a vision-language model, then renames into place.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rl.convert.architecture import config_from_dict
from megatron_rl.convert.checkpoint import FORMAT, FORMAT_VERSION, HF_FILES_DIR, META_FILE, MODEL_DIR
from megatron_rl.convert.checks import (
    ConfigMismatchError,
    check_output,
    check_parallel_sizes,
    config_errors,
    nonfinite_problem,
    read_config_json,
    refuse_or_warn,
    same_bits,
    show_progress,
    stage,
)
from megatron_rl.convert.ranks import group_rank, quiet_megatron_warnings, run_on_ranks
from megatron_rl.errors import InputError, UsageError
from megatron_rl.fileio import atomic_output_dir
from megatron_rl.hf.arch import language_model_dict
from megatron_rl.hf.files import (
    CARRIED_FILE,
    HFWeights,
    carried_tensors,
    copy_side_files,
    dtype_name,
    parse_dtype,
    write_carried,
)
from megatron_rl.hf.layout import HFConverter
from megatron_rl.training.chunks import chunk_global_names, load_hf_into_chunk
from megatron_rl.training.model import build_gpt_model, save_model_checkpoint, transformer_config_from_hf
from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy this name is Any.
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.fileio import JsonValue

__all__ = ["HFPlan", "hf_to_mcore", "plan_hf_to_mcore"]


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
