"""Checkpoint conversion throughput: HF -> Megatron -> HF against a plain safetensors copy.

    megatron-rl bench convert [--small] [--dtype bf16] [--max-shard-size 200MB] [--dir DIR]

Generates a Llama-style model of a few hundred MB (``--small``: a few MB, for tests) as HF
safetensors shards, then times, in this one process and on the same files:

- baseline: ``safetensors.torch.load_file`` + ``save_file`` of every shard (a plain copy through
  memory, the least any converter must do);
- ``hf_to_mcore`` at TP=1 PP=1 (build the model, fill it, ``dist_checkpointing.save``);
- ``mcore_to_hf`` (read the dist checkpoint layer by layer, write HF shards).

Throughput is model bytes / seconds; ``convert_gbps`` counts both directions (2 x bytes over the
round-trip time). Once-per-process costs (imports; the Manager process Megatron's checkpoint
writer spawns on its first save) are paid before the clocks start and printed. The converters
fsync their output before renaming it into place, so the headline ``ratio_to_durable_copy``
compares them with the copy + fsync (the baseline a user would pick: it is what a safe copy
costs); ``ratio_to_safetensors_copy`` (no fsync) is printed too. The files each step reads were
written just before it, so every side reads from a warm page cache alike. The round trip is
checked to be exact. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.errors import ArgumentParser, run_cli

SIZES = {  # Llama-style shapes: ~156M parameters (~310 MB in bf16), or ~3M for --small
    "default": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "small": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4000,
    ),
}


def make_model(folder: Path, size: str, dtype: torch.dtype, max_shard_size: str) -> int:
    """Write a random HF Llama model (config.json + safetensors shards); returns its bytes."""
    import transformers

    from megatron_rl.hf.files import ShardWriter, dtype_name, parse_size
    from megatron_rl.hf.layout import HFConverter

    config = transformers.LlamaConfig(
        **SIZES[size], tie_word_embeddings=False, max_position_embeddings=4096, dtype=dtype_name(dtype)
    )
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    writer = ShardWriter(folder, parse_size(max_shard_size))
    for name, shape in HFConverter.for_config(config).expected_hf_shapes().items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    return writer.total_bytes


def safetensors_copy(src: Path, dst: Path) -> float:
    """Seconds to load and save every shard of ``src`` into ``dst`` with plain safetensors."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    start = time.perf_counter()
    for shard in sorted(src.glob("*.safetensors")):
        save_file(load_file(str(shard)), str(dst / shard.name), metadata={"format": "pt"})
    return time.perf_counter() - start


def _same(a: Path, b: Path) -> bool:
    from megatron_rl.hf.files import HFWeights

    x, y = HFWeights(a), HFWeights(b)
    return set(x) == set(y) and all(x[n].dtype == y[n].dtype and torch.equal(x[n], y[n]) for n in x)


def _warm_up() -> float:
    """Pay the once-per-process costs before the clocks start; returns their seconds."""
    start = time.perf_counter()
    import megatron.core.models.gpt  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    import megatron_rl.convert.from_hf
    import megatron_rl.convert.to_hf  # noqa: F401
    from megatron_rl.training.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    # Megatron's checkpoint writer starts a multiprocessing Manager (a spawned interpreter) on
    # its first save in a process and reuses it afterwards.
    filesystem_async._get_write_results_queue()
    return time.perf_counter() - start


def safetensors_copy_fsync(src: Path, dst: Path) -> float:
    """As :func:`safetensors_copy`, then fsync every file (what the converters do before
    publishing their output): the share of the gap that is durability, not conversion."""
    from megatron_rl.fileio import fsync_tree

    start = time.perf_counter()
    safetensors_copy(src, dst)
    fsync_tree(dst)
    return time.perf_counter() - start


def run(args: argparse.Namespace, root: Path) -> dict:
    from megatron_rl.convert.from_hf import hf_to_mcore
    from megatron_rl.convert.to_hf import mcore_to_hf
    from megatron_rl.hf.files import parse_dtype

    size = "small" if args.small else "default"
    nbytes = make_model(root / "hf", size, parse_dtype(args.dtype), args.max_shard_size)
    t_warm = _warm_up()
    t_copy = safetensors_copy(root / "hf", root / "copy")
    t_fsync = safetensors_copy_fsync(root / "hf", root / "copy_fsync")
    start = time.perf_counter()
    hf_to_mcore(root / "hf", root / "mcore")
    t_h2m = time.perf_counter() - start
    start = time.perf_counter()
    mcore_to_hf(root / "mcore", root / "hf_back", max_shard_size=args.max_shard_size)
    t_m2h = time.perf_counter() - start
    if not _same(root / "hf", root / "hf_back"):
        raise SystemExit("bench convert: the round trip changed the weights")
    gb = nbytes / 1e9
    copy_gbps, convert_gbps = gb / t_copy, 2 * gb / (t_h2m + t_m2h)
    rows = [
        ("safetensors load+save (baseline)", t_copy, copy_gbps),
        ("  the same + fsync", t_fsync, gb / t_fsync),
        ("hf -> mcore (TP1 PP1)", t_h2m, gb / t_h2m),
        ("mcore -> hf", t_m2h, gb / t_m2h),
        ("round trip, both directions", t_h2m + t_m2h, convert_gbps),
    ]
    print(
        f"model: Llama-style {size}, {nbytes / 1e6:.1f} MB in {args.dtype}, shards of at most "
        f"{args.max_shard_size}; round trip exact: yes; once-per-process start-up (imports, "
        f"Megatron's writer Manager), not timed below: {t_warm:.1f} s"
    )
    print(f"{'step':36} {'seconds':>8} {'GB/s':>7} {'÷ copy':>7}")
    for label, seconds, gbps in rows:
        print(f"{label:36} {seconds:8.2f} {gbps:7.3f} {gbps / copy_gbps:7.2f}")
    return {
        "convert_gbps": round(convert_gbps, 4),
        # The fair baseline is the durable copy: the converters fsync what they write.
        "ratio_to_durable_copy": round(convert_gbps / (gb / t_fsync), 4),
        "ratio_to_safetensors_copy": round(convert_gbps / copy_gbps, 4),
        "hf_to_mcore_gbps": round(gb / t_h2m, 4),
        "mcore_to_hf_gbps": round(gb / t_m2h, 4),
        "safetensors_copy_gbps": round(copy_gbps, 4),
        "safetensors_copy_fsync_gbps": round(gb / t_fsync, 4),
        "model_bytes": nbytes,
        "dtype": args.dtype,
        "size": size,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a ~3M-parameter model (quick check)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--max-shard-size", default="200MB", help="HF shard size, input and output")
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed afterwards)")
    args = ap.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-convert-"))
    try:
        out = run(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench convert", main))
