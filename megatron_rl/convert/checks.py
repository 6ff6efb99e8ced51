"""What a conversion checks before it starts ranks, loads weights or writes a byte, and the
non-finite check while it streams.

- :func:`check_output`: ``--out`` apart from every input (:func:`~megatron_rl.fileio.check_output_apart`),
  absent unless ``--overwrite``, its parent a writable folder (:class:`OutputError`).
- :func:`read_config_json`: a config.json that is JSON and an object (:class:`InputError`, with
  line and column).
- :func:`check_parallel_sizes`: ``--tp`` / ``--pp`` against the config (which fields they must
  divide, and the sizes that would), and the config's own head arithmetic.
- :func:`config_errors`: the ValueErrors of the HF config readers and the name map (they name a
  config field) as an :class:`InputError` that also names the config file.
- :func:`nonfinite_problem` / :func:`refuse_or_warn`: a tensor holding NaN or Inf, refused
  unless ``--allow-nonfinite``.
- :func:`stage`: the one-line progress reports.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_rl.errors import InputError, OutputError, UsageError, UserError
from megatron_rl.fileio import JsonValue, check_output_apart
from megatron_rl.hf.arch import mla_settings, moe_settings
from megatron_rl.hf.files import (  # re-exported: the convert checks' home for them
    nonfinite_problem,
    read_config_json,
)
from megatron_rl.hf.layout import WeightsMismatchError

__all__ = [
    "ConfigMismatchError",
    "check_dist_files",
    "check_output",
    "check_parallel_sizes",
    "config_errors",
    "dist_read_error",
    "nonfinite_problem",
    "overflow_problem",
    "read_config_json",
    "refuse_or_warn",
    "same_bits",
    "show_progress",
    "stage",
]

ALLOW_NONFINITE = "pass --allow-nonfinite (allow_nonfinite=True) to convert it anyway"


class ConfigMismatchError(WeightsMismatchError, InputError):
    """A config.json that does not describe its weights, or contradicts itself: names the file
    and the field (``field``), and is an :class:`InputError` (exit code 3)."""

    def __init__(self, path: str | os.PathLike[str], field: str, message: str):
        ValueError.__init__(self, f"{path}: {field}: {message}")
        self.field = field


@contextlib.contextmanager
def config_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Re-raise a ValueError of the config readers or the name map (each names a config field)
    as an InputError that also names ``path``, the config file it came from."""
    try:
        yield
    except UserError:
        raise
    except WeightsMismatchError as e:
        raise ConfigMismatchError(path, e.field, str(e).removeprefix(f"{e.field}: ")) from None
    except (ValueError, TypeError) as e:  # transformers' own validators raise these on a bad config
        raise InputError(f"{path}: {' '.join(str(e).split())}") from None


def check_output(
    out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None], *, overwrite: bool
) -> None:
    """Refuse ``--out`` before anything is read or written (:class:`OutputError`): it is, holds
    or lies inside an input; it exists and ``overwrite`` is off; or it cannot be created."""
    for given in inputs:
        check_output_apart(out, [given], what="--out")
    path = Path(out).absolute()
    if path.exists() and not overwrite:
        raise OutputError(f"--out {out} exists; remove it or pass --overwrite")
    if path.exists() and not path.is_dir():
        raise OutputError(f"--out {out} is a file; give a folder path")
    parent = path.parent
    while not parent.exists():  # the nearest existing ancestor decides whether it can be made
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"--out {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out}: the folder {parent} is not writable")


def _int_field(config: dict[str, JsonValue], path: Path, name: str, default: int | None = None) -> int | None:
    value = config.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{path}: {name}: must be an integer >= 1, got {value!r}")
    return value


def _sizes_dividing(values: list[int], limit: int = 64) -> str:
    sizes = [n for n in range(1, limit + 1) if all(v % n == 0 for v in values)]
    return ", ".join(map(str, sizes))


def check_parallel_sizes(
    config: dict[str, JsonValue],
    path: str | os.PathLike[str],
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
) -> None:
    """Check ``--tp`` / ``--pp`` against config.json ``path`` (its dict ``config``) before any
    rank starts: UsageError naming the flag, the field it must divide and the sizes that do;
    InputError naming the field where the config contradicts itself (heads and sizes)."""
    path = Path(path)
    for flag, value in (("--tp", tensor_parallel), ("--pp", pipeline_parallel)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{flag}: must be an integer >= 1, got {value!r}")
    hidden = _int_field(config, path, "hidden_size")
    heads = _int_field(config, path, "num_attention_heads")
    layers = _int_field(config, path, "num_hidden_layers")
    ffn = _int_field(config, path, "intermediate_size")
    if hidden is None or heads is None or layers is None:
        missing = [
            n
            for n, v in (
                ("hidden_size", hidden),
                ("num_attention_heads", heads),
                ("num_hidden_layers", layers),
            )
            if v is None
        ]
        raise InputError(f"{path}: {missing[0]}: missing (a decoder config has it)")
    kv_heads = _int_field(config, path, "num_key_value_heads") or heads
    head_dim = _int_field(config, path, "head_dim")
    if head_dim is None and hidden % heads:
        raise InputError(
            f"{path}: num_attention_heads: {heads} does not divide hidden_size={hidden} and no "
            "head_dim is given; set head_dim or a head count that divides hidden_size"
        )
    if heads % kv_heads:
        raise InputError(
            f"{path}: num_key_value_heads: {kv_heads} does not divide num_attention_heads={heads}"
        )
    split = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if ffn is not None:
        split["intermediate_size"] = ffn
    try:
        moe, mla = moe_settings(config), mla_settings(config)
    except ValueError as e:  # names the field
        raise InputError(f"{path}: {e}") from None
    if moe is not None:
        split[moe.ffn_field] = moe.ffn
        if moe.shared_ffn:
            split["n_shared_experts x moe_intermediate_size"] = moe.shared_ffn
    if mla is not None:  # its down projections are column-parallel too
        split["kv_lora_rank + qk_rope_head_dim"] = mla.kv_lora_rank + mla.qk_rope
        if mla.q_lora_rank:
            split["q_lora_rank"] = mla.q_lora_rank
    for field, n in split.items():
        if n % tensor_parallel:
            raise UsageError(
                f"--tp {tensor_parallel}: does not divide {field}={n} of {path}; --tp must divide "
                f"{', '.join(f'{k}={v}' for k, v in split.items())} (it can be "
                f"{_sizes_dividing(list(split.values()))})"
            )
    if layers % pipeline_parallel:
        raise UsageError(
            f"--pp {pipeline_parallel}: does not divide num_hidden_layers={layers} of {path}; "
            f"--pp must divide it (it can be {_sizes_dividing([layers])})"
        )


def overflow_problem(name: str, source: torch.Tensor, cast: torch.Tensor, where: str) -> str | None:
    """None unless casting the finite ``source`` to ``cast``'s dtype made values infinite; then
    the refusal naming ``name``, the largest magnitude and the dtype's limit."""
    if not cast.is_floating_point() or bool(torch.isfinite(cast).all()):
        return None
    dtype = str(cast.dtype).removeprefix("torch.")
    big = float(source.float().abs().max())
    return (
        f"{where}: tensor {name} overflows {dtype} (largest magnitude {big:.4g}, {dtype} holds up to "
        f"{torch.finfo(cast.dtype).max:.4g}); choose --dtype bf16 or fp32"
    )


def refuse_or_warn(problem: str | None, allow_nonfinite: bool, *, warn: bool = True) -> None:
    """Raise InputError for ``problem`` (a non-finite tensor) unless ``allow_nonfinite``; then
    print it as a one-line warning on stderr (when ``warn``: rank 0 only)."""
    if problem is None:
        return
    if not allow_nonfinite:
        raise InputError(f"{problem}; {ALLOW_NONFINITE}")
    if warn:
        print(
            f"megatron-rl convert: warning: {problem}; converted as it is (--allow-nonfinite)",
            file=sys.stderr,
        )


def stage(show: bool, text: str) -> None:
    """One progress line on stderr (``show``: the caller asked for progress)."""
    if show:
        print(f"megatron-rl convert: {text}", file=sys.stderr, flush=True)


def show_progress(progress: bool | None) -> bool:
    """``progress`` resolved: None shows progress when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else progress


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN equals itself here, unlike in ``torch.equal``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --------------------------------------------------------------------------- dist checkpoints


def _dcp_metadata(dist_dir: Path):
    """torch.distributed.checkpoint's metadata of ``dist_dir`` (which file holds which bytes)."""
    from torch.distributed.checkpoint import FileSystemReader  # lazy: torch; the parser's checks must not

    try:
        return FileSystemReader(str(dist_dir)).read_metadata()
    except Exception as e:  # noqa: BLE001 -- a pickle cut short raises any of several types
        raise InputError(
            f"{dist_dir / '.metadata'}: cannot be read ({type(e).__name__}: {_first_line(e)}); "
            "the checkpoint is truncated or corrupt"
        ) from None


def _first_line(e: BaseException) -> str:
    """The gist of a loader's error: its first line, up to the first full stop."""
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0] if text else type(e).__name__


def check_dist_files(dist_dir: str | os.PathLike[str]) -> None:
    """Every file a ``dist_checkpointing`` folder's ``.metadata`` points into exists and is long
    enough; InputError naming the first file that is missing or truncated. Reads no tensor."""
    dist_dir = Path(dist_dir)
    need: dict[str, int] = {}
    for info in _dcp_metadata(dist_dir).storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = dist_dir / rel
        if not path.is_file():
            raise InputError(f"{path}: missing (the checkpoint's .metadata lists it)")
        have = path.stat().st_size
        if have < size:
            raise InputError(
                f"{path}: truncated: {have} bytes, the checkpoint's .metadata needs at least {size}"
            )


def dist_read_error(
    dist_dir: str | os.PathLike[str], keys: Iterable[str], error: BaseException
) -> InputError:
    """The InputError for a failed ``dist_checkpointing.load`` of ``keys`` from ``dist_dir``:
    each stored piece of those tensors is read on its own to name the file (and tensor) that
    does not load; failing that, the folder and the loader's first line."""
    dist_dir, wanted = Path(dist_dir), set(keys)
    meta = _dcp_metadata(dist_dir)
    for index, info in meta.storage_data.items():
        if index.fqn not in wanted:
            continue
        path = dist_dir / info.relative_path
        try:
            with path.open("rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- any failure here is the answer being looked for
            return InputError(
                f"{path}: tensor {index.fqn} cannot be read ({_first_line(e)}); the shard is corrupt"
            )
    return InputError(f"{dist_dir}: the checkpoint cannot be read ({_first_line(error)})")
