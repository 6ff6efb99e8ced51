"""Megatron -> HF: a Megatron model checkpoint exported as a Hugging Face model folder
(:mod:`megatron_rl.convert.checkpoint` describes the formats it reads, the memory each direction
needs, and the refusals).

    mcore_to_hf("qwen-mcore/", "qwen-hf/", max_shard_size="5GB")
    mcore_to_hf("run/checkpoints/step_00000100/dist", "step100-hf/", hf_config="Qwen2.5-7B/")

One process, whatever layout wrote the checkpoint, and no model built:
:class:`~megatron_rl.convert.checkpoint.McoreCheckpoint` reads the layers in turn, the name map
(:class:`~megatron_rl.hf.layout.HFConverter`) turns each into HF tensors, cast to the chosen
dtype and checked for NaN, Inf and overflow, and HF shards are written as they fill. The
config.json exported is the one given, checked against the stored one
(:func:`~megatron_rl.convert.architecture.check_same_architecture`), or the stored one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from tqdm import tqdm

from megatron_rl.convert.architecture import check_same_architecture, config_from_dict
from megatron_rl.convert.checkpoint import META_FILE, McoreCheckpoint, single_process_group
from megatron_rl.convert.checks import (
    check_output,
    config_errors,
    nonfinite_problem,
    overflow_problem,
    read_config_json,
    refuse_or_warn,
    show_progress,
    stage,
)
from megatron_rl.convert.ranks import quiet_megatron_warnings
from megatron_rl.errors import InputError, UsageError
from megatron_rl.fileio import atomic_output_dir
from megatron_rl.hf.arch import language_model_config
from megatron_rl.hf.files import (
    CARRIED_FILE,
    ShardWriter,
    carried_tensors,
    copy_side_files,
    dtype_name,
    parse_dtype,
    parse_size,
)
from megatron_rl.hf.layout import HFConverter

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["mcore_to_hf"]


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
    """Export a Megatron checkpoint as an HF model folder (the checkpoints it reads:
    :class:`~megatron_rl.convert.checkpoint.McoreCheckpoint`).

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
    with quiet_megatron_warnings(), single_process_group():
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
