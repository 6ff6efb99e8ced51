"""``megatron-rl eval``: k samples per problem through a model or the fleet, scored by the real
reward; pass@1 (averaged over k), unbiased pass@k, maj@k, per-task and per-language results and
length statistics, as JSON + Markdown + PNG.

    megatron-rl eval --model ckpt-hf/ --data aime.jsonl --k 16 --out eval/aime
    megatron-rl eval --servers http://gen0:30000,http://gen1:30000 --tokenizer ckpt-hf/ \\
        --data gpqa.csv --format gpqa --k 8 --max-new-tokens 32768 --out eval/gpqa reward.workers=8
    python -m megatron_rl.cli.evaluate ...   (the same)

``--data`` takes this project's problem files or benchmark formats (``--format``: aime, gpqa,
lcb; auto-detected by default; see :mod:`megatron_rl.data.benchmarks`). Prompts are the training
prompts (system prompt and task instruction through the tokenizer's chat template). Trailing
``reward.KEY=VALUE`` arguments override the reward settings (as in a recipe). Outputs in ``--out``:
see :mod:`megatron_rl.evaluation.report`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_rl.cli.reward import env_config, reward_config
from megatron_rl.data.benchmarks import FORMATS, load_benchmark
from megatron_rl.data.problems import DataError
from megatron_rl.data.sampling import (
    SamplingConfig,
    check_think_tags_in,
    close_generator,
    load_tokenizer,
    open_generator,
    render_prompt,
    sample_and_score,
    sequence_budget,
)
from megatron_rl.errors import ArgumentParser, OutputError, float_arg, int_arg, run_cli, value_errors_as_usage
from megatron_rl.evaluation.metrics import default_ks
from megatron_rl.evaluation.report import REPORT_FILES, evaluate, write_report
from megatron_rl.fileio import check_output_apart
from megatron_rl.rewards.pool import VerifierPool
from megatron_rl.rewards.template import system_prompt

__all__ = ["add_generator_args", "build_parser", "main"]


def add_generator_args(p: argparse.ArgumentParser) -> None:
    """--model / --servers / --tokenizer and the engine's sizes (shared with ``curate``)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model folder, run in this process")
    src.add_argument("--servers", help="comma-separated URLs of generation servers (the fleet)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the --model folder)")
    p.add_argument(
        "--max-slots",
        type=int_arg(1, 1 << 16),
        default=16,
        help="--model only: sequences decoded together (default 16)",
    )


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or ArgumentParser(prog="megatron-rl eval", description=__doc__.split("\n\n")[0])
    add_generator_args(p)
    p.add_argument("--data", required=True, help="problems or benchmark file (JSONL, CSV, Parquet, hf:NAME)")
    p.add_argument("--format", default="auto", choices=FORMATS, help="input format (default: auto)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--k", type=int_arg(1, 1 << 16), default=16, help="samples per problem (default 16)")
    p.add_argument(
        "--max-new-tokens", type=int_arg(1, 1 << 24), default=4096, help="completion budget (default 4096)"
    )
    p.add_argument("--temperature", type=float_arg(0.0, 100.0), default=1.0)
    p.add_argument("--top-p", type=float_arg(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument(
        "--seed", type=int_arg(0, 2**63 - 1), default=0, help="base of the per-request sampling seeds"
    )
    p.add_argument("--limit", type=int_arg(1), help="evaluate only the first N problems")
    p.add_argument("--workers", type=int_arg(1, 4096), help="verifier processes (default: reward.workers)")
    p.add_argument("--recipe", help="YAML recipe whose reward section is used")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", help="reward.KEY=VALUE overrides, e.g. reward.l_max=32768")
    p.set_defaults(func=_entry)
    return p


def run(args: argparse.Namespace) -> int:
    """Evaluate; every argument is checked before the model loads: the report folder must be a
    folder apart from everything read (OutputError), the recipe and overrides must load."""
    reads = [x for x in (args.data, args.recipe, args.tokenizer, args.model) if x and not x.startswith("hf:")]
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise OutputError(f"--out {args.out}: is a file; the report is a folder")
    for name in REPORT_FILES:  # the folder may hold inputs; the files written into it may not be one
        check_output_apart(Path(args.out) / name, reads, what="the report file")
    reward_cfg = reward_config(args.recipe, args.overrides, args.workers)
    sampling = SamplingConfig(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        system_prompt=system_prompt(reward_cfg.think_tags),
        env=env_config(args.recipe, args.overrides),  # evaluated through the run's environment
    )
    problems, load_report = load_benchmark(args.data, args.format, seed=args.seed)
    if args.limit is not None:
        problems = problems[: args.limit]
    if not problems:
        raise DataError(f"{args.data}: no problems to evaluate")
    if load_report.dropped:
        load_report.print()
    if args.tokenizer is None and args.model is None:
        raise ValueError("--servers needs --tokenizer (the served model's tokenizer folder)")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    check_think_tags_in(tokenizer, reward_cfg.think_tags, name=args.tokenizer or args.model)
    longest = max(len(render_prompt(tokenizer, p.problem, p.task)) for p in problems)
    generator = open_generator(
        model=args.model,
        servers=args.servers.split(",") if args.servers else None,
        max_len=sequence_budget(sampling, longest),
        max_slots=args.max_slots,
    )
    start = time.monotonic()
    ks = default_ks(args.k)
    try:
        with VerifierPool(reward_cfg.workers) as pool:
            attempts = sample_and_score(
                problems, generator, tokenizer, sampling, reward_cfg, pool=pool, progress=not args.quiet
            )
            results = evaluate(
                problems, attempts, ks, pool=pool, math_cfg=reward_cfg.math, progress=not args.quiet
            )
    finally:
        close_generator(generator)
    settings = {
        "model": args.model or args.servers,
        "data": args.data,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "problems": len(problems),
        "seconds": round(time.monotonic() - start, 1),
    }
    summary = write_report(args.out, problems, attempts, results, ks, settings)
    overall = summary["overall"]
    maj = "–" if overall["maj"] is None else f"{100 * overall['maj']:.1f}"
    print(
        f"eval: {len(problems)} problems x {args.k} samples: pass@1 "
        f"{100 * overall['pass_at']['1']:.1f}, pass@{args.k} {100 * overall['pass_at'][str(args.k)]:.1f}, "
        f"maj@{args.k} {maj}, mean length {overall['length']['all']['mean']:.0f} tokens; "
        f"report in {args.out}/report.md"
    )
    return 0


def _entry(args: argparse.Namespace) -> int:
    with value_errors_as_usage():  # an option the data or a config refuses: exit 2
        return run(args)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (without the leading ``eval``) and run; 2 with a one-line error on bad input."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl eval", main))
