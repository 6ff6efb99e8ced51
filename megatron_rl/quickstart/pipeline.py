"""``megatron-rl quickstart``: the whole recipe on a laptop, from nothing to an RL-trained policy.

    megatron-rl quickstart [--out runs/quickstart] [--recipe examples/quickstart.yaml] [k=v ...]
    megatron-rl quickstart --model smollm2 [--out runs/quickstart-smollm2] [k=v ...]

``--model smollm2`` is the same path on a real pretrained model, with the cold start, difficulty
filter and three-stage report of :mod:`megatron_rl.quickstart.pretrained`; the tiny model below
is the default.

1. **Warm-up** (:mod:`megatron_rl.quickstart.warmup`, reused when ``OUT/warmup/warmup.json``
   exists): generated arithmetic and linear-equation problems (train / held-out), a small BPE
   tokenizer, a tiny Llama, a short SFT on traces in the paper's format
   (``<think>…</think>`` then ``\\boxed{}``), held-out pass@1 of the SFT model.
2. **GRPO** (``megatron-rl train`` on ``examples/quickstart.yaml``, or ``--recipe``): the
   recipe's loop (async in the default recipe) with the full reward (format, math-verify
   correctness, length penalty, language consistency), built-in engine servers, the verifier
   pool and the Megatron trainer; held-out pass@1 before and after RL, metrics, samples,
   checkpoints and ``plots/training.png`` in ``OUT/rl``.
3. ``OUT/quickstart.json``: the before/after figures and where everything is.

Each stage runs in a process of its own (each sets up its own Megatron state); Ctrl-C stops the
current one, and running the command again resumes the RL run from its last checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from megatron_rl.errors import ArgumentParser, OutputError, UsageError, run_cli
from megatron_rl.fileio import atomic_write_json, check_output_apart
from megatron_rl.orchestration.recipe import RunConfig, load_config
from megatron_rl.quickstart.pretrained import PLAN_SIZES, add_plan_args, plan_of, run_pretrained
from megatron_rl.quickstart.stages import run_stage, train_command
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS

__all__ = ["ensure_warmup", "main"]

DEFAULT_RECIPE = Path(__file__).resolve().with_name("recipe.yaml")  # examples/quickstart.yaml links to it


def _check_inputs(out: Path, recipe: str, overrides: list[str]) -> RunConfig:
    """Everything the command is given, checked before the minutes of warm-up start: the recipe
    and its overrides (ConfigError naming the file, line and field; the paths the warm-up will
    fill in are not checked yet), and the output folder (a folder, never where the recipe is)."""
    cfg = load_config(recipe, overrides)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file; the quick start writes a folder there")
    for written in (out / "warmup", out / "rl", out / "quickstart.json"):
        check_output_apart(written, [recipe], what="the quick start's output")
    return cfg


def ensure_warmup(warm: Path, tags: list[str]) -> dict[str, Any]:
    """The warm-up in ``warm`` (run in a process of its own unless ``warm/warmup.json`` exists):
    its record, with ``paths`` (``sft``, ``train``, ``held_out``) and ``seconds``. OutputError
    when the folder's warm-up taught other think tags than ``tags``."""
    if not (warm / "warmup.json").exists():
        run_stage(
            "warm-up: data, tokenizer, tiny model, SFT",
            [
                sys.executable,
                "-m",
                "megatron_rl.quickstart.warmup",
                "--out",
                str(warm),
                "--think-tags",
                *tags,
            ],
        )
    else:
        print(f"== warm-up: reusing {warm}", file=sys.stderr)
    warmup: dict[str, Any] = json.loads((warm / "warmup.json").read_text())
    built = warmup.get("think_tags", list(DEFAULT_THINK_TAGS))  # before the field: the default
    if built != tags:
        raise OutputError(
            f"{warm}: this warm-up taught the tags {built}, this run's reward.think_tags are "
            f"{tags}; use another output folder (or remove {warm}) to warm up with them"
        )
    return warmup


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="megatron-rl quickstart", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (reused to resume; default runs/quickstart[-MODEL])")
    p.add_argument("--recipe", help="the RL recipe (default: the model's, examples/quickstart*.yaml)")
    add_plan_args(p)
    p.add_argument("overrides", nargs="*", help="overrides for the RL recipe, e.g. loop.max_steps=20")
    args = p.parse_intermixed_args(argv)
    if args.model != "tiny":
        plan = plan_of(args)
        out = Path(args.out or f"runs/quickstart-{args.model}").absolute()
        report = run_pretrained(plan, out, args.recipe or str(plan.recipe), args.overrides)
        _say_pretrained(report)
        print(json.dumps(report))
        return 0
    sizes = [f"--{k.replace('_', '-')}" for k in PLAN_SIZES if getattr(args, k) is not None]
    if sizes:
        raise UsageError(f"{sizes[0]}: only the real-model quick start (--model smollm2) takes it")
    args.recipe = args.recipe or str(DEFAULT_RECIPE)
    out = Path(args.out or "runs/quickstart").absolute()
    cfg = _check_inputs(out, args.recipe, args.overrides)
    warm = out / "warmup"
    t0 = time.monotonic()
    warmup = ensure_warmup(warm, list(cfg.reward.think_tags))
    paths = warmup["paths"]
    rl = out / "rl"
    run_stage(
        f"GRPO ({cfg.loop.mode} loop, full reward)", train_command(args.recipe, paths, rl, args.overrides)
    )
    summary = json.loads((rl / "summary.json").read_text())
    report = {
        "pass@1_sft": summary["pass@1_before"],
        "pass@1_rl": summary["pass@1_after"],
        "rl_steps": summary["steps"],
        "rl_stopped": summary.get("stopped"),
        "rl_wall_s": summary["wall_s"],
        "warmup_s": warmup["seconds"].get("total"),
        "total_s": time.monotonic() - t0,
        "plots": summary["plots"],
        "run_dir": str(rl),
        "policy": str(rl / "hf"),
    }
    atomic_write_json(out / "quickstart.json", report)  # atomic
    b, a = report["pass@1_sft"], report["pass@1_rl"]
    if report["rl_stopped"] == "time_limit":
        print(
            f"\nRL stopped at its time limit (run.time_limit_min) after {report['rl_steps']} "
            f"steps; run the same command again to continue",
            file=sys.stderr,
        )
    print(
        f"\nheld-out pass@1: SFT {b:.3f} -> after GRPO {a:.3f}  ({a - b:+.3f})\n"
        f"plots: {', '.join(report['plots'])}\nRL policy (HF folder): {report['policy']}\n"
        f"this run: {report['total_s'] / 60:.1f} min",
        file=sys.stderr,
    )
    print(json.dumps(report))
    return 0


def _say_pretrained(report: dict[str, Any]) -> None:
    fmt = lambda key: "-" if report.get(key) is None else f"{report[key]:.3f}"
    if report["rl_stopped"] == "time_limit":
        print(
            f"\nRL stopped at its time limit (run.time_limit_min) after {report['rl_steps']} "
            "steps; run the same command again to continue",
            file=sys.stderr,
        )
    print(
        f"\nheld-out pass@1 ({report['held_out_problems']} problems): shipped {fmt('pass@1_base')} "
        f"-> after SFT {fmt('pass@1_sft')} -> after GRPO {fmt('pass@1_rl')}\n"
        f"plots: {', '.join(report['plots'])}\nRL policy (HF folder): {report['policy']}\n"
        f"this run: {report['total_s'] / 60:.1f} min",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl quickstart", main))
