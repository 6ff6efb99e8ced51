"""One conversion as a user starts it, from the shell (``megatron-rl convert``) or from Python
(``megatron_rl.convert_checkpoint``): the same function, so both check the same things, start
their ranks the same way (:func:`~megatron_rl.convert.ranks.run_on_ranks`) and report the same
progress.

    convert("hf-to-mcore", "Qwen2.5-7B/", "qwen-mcore/", tensor_parallel=2)
    convert("mcore-to-hf", "qwen-mcore/", "qwen-hf/", max_shard_size="5GB")
    convert("gguf-to-hf", "smollm2", "smollm2-hf/")   # a GGUF file dequantized (convert/from_gguf.py)

Progress goes to stderr: one line per stage and a progress bar while tensors stream
(``progress=None``: only when stderr is a terminal; the command line's default), then the
closing line ``wrote N tensors, X GB, in T s to OUT`` (unless ``progress=False``). Refusals are
:mod:`megatron_rl.errors` exceptions, raised before the first progress line wherever the check
needs no weights read.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Literal

from megatron_rl.errors import UsageError

__all__ = ["DIRECTIONS", "convert"]

Direction = Literal["hf-to-mcore", "mcore-to-hf", "gguf-to-hf"]
DIRECTIONS: tuple[Direction, ...] = ("hf-to-mcore", "mcore-to-hf", "gguf-to-hf")


def _summary(out: Path, seconds: float, what: str) -> str:
    """The one line a conversion ends with: what it wrote, how much, how fast, where."""
    from megatron_rl.convert.checkpoint import output_summary  # lazy: torch

    tensors, nbytes = output_summary(out)
    return (
        f"megatron-rl convert: wrote {tensors} tensors, {nbytes / 1e9:.3g} GB, in {seconds:.1f} s "
        f"to {out} ({what})"
    )


def convert(
    direction: Direction,
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    hf_config: str | os.PathLike[str] | None = None,
    dtype: str = "keep",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Convert ``src`` into ``out`` in ``direction`` (module docstring); returns ``out``.

    ``hf-to-mcore`` writes at ``tensor_parallel x pipeline_parallel``, starting that many local
    CPU ranks unless this process is one of a group that can hold them (``torchrun``);
    ``mcore-to-hf`` reads any layout in one process, so both must stay 1 (``hf_config``: the HF
    folder to export with). UsageError for an argument that does not fit, before anything runs.
    """
    from megatron_rl.convert.from_gguf import gguf_to_hf  # lazy: torch, transformers
    from megatron_rl.convert.from_hf import hf_to_mcore  # lazy: torch, megatron-core
    from megatron_rl.convert.ranks import group_rank  # lazy: it imports torch.distributed
    from megatron_rl.convert.to_hf import mcore_to_hf  # lazy: torch, megatron-core

    start = time.perf_counter()
    if direction == "hf-to-mcore":
        if hf_config is not None:
            raise UsageError("hf_config: only for mcore-to-hf (hf-to-mcore reads the config in --hf)")
        written = hf_to_mcore(
            src,
            out,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            dtype=dtype,
            overwrite=overwrite,
            allow_nonfinite=allow_nonfinite,
            progress=progress,
        )
        what = f"from {src}, at TP={tensor_parallel} PP={pipeline_parallel}"
    elif direction == "mcore-to-hf":
        if (tensor_parallel, pipeline_parallel) != (1, 1):
            raise UsageError(
                "tensor_parallel / pipeline_parallel: an HF export has no layout (any layout's "
                "checkpoint is read in one process); leave them at 1"
            )
        written = mcore_to_hf(
            src,
            out,
            hf_config=hf_config,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            allow_nonfinite=allow_nonfinite,
            progress=progress,
        )
        what = f"from {src}"
    elif direction == "gguf-to-hf":
        if (tensor_parallel, pipeline_parallel) != (1, 1) or hf_config is not None:
            raise UsageError(
                "gguf-to-hf: writes an HF folder; tensor_parallel, pipeline_parallel, hf_config do not apply"
            )
        written = gguf_to_hf(
            src,
            out,
            dtype="fp32" if dtype == "keep" else dtype,
            overwrite=overwrite,
            progress=progress is not False,
        )
        what = f"from {src}, dequantized"
    else:
        raise UsageError(f"direction: must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if progress is not False and group_rank() == 0:  # under torchrun, one line, not one per rank
        print(_summary(Path(written), time.perf_counter() - start, what), file=sys.stderr, flush=True)
    return Path(written)
