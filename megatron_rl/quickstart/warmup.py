"""The CPU quick start up to the RL loop: data, tokenizer, tiny model, SFT warm-up, held-out eval.

    python -m megatron_rl.quickstart.warmup --out runs/quickstart      # ~3 min on 2 idle cores

or from Python::

    result = run_warmup("runs/quickstart")
    result.paths["sft"]        # HF folder RL starts from (engine and trainer both load it)
    result.eval.pass_at_1      # held-out pass@1 at temperature 1.0

Output folder::

    train.jsonl  held_out.jsonl   problems (id, problem, answer, task, difficulty)
    tokenizer/                    BPE tokenizer + chat template (AutoTokenizer loads it)
    init/                         HF folder, random weights
    sft/                          HF folder after the SFT warm-up
    warmup.json                   the figures below

The defaults are tuned so that the SFT model is clearly better than chance but far from solved
at temperature 1.0 (held-out pass@1 about 0.15, greedy about 0.27, format above 0.99), with room
that GRPO fills within minutes: see "A teacher that slips" in :mod:`megatron_rl.quickstart.sft`.

A script that calls :func:`run_warmup` needs the ``if __name__ == "__main__":`` guard: the
verifier pool starts its workers from a forkserver, which imports the main module again.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.data.problems import write_problems
from megatron_rl.errors import ArgumentParser, float_arg, int_arg, run_cli
from megatron_rl.fileio import atomic_write_json
from megatron_rl.generation.api import LocalGenerator
from megatron_rl.quickstart.evaluate import EvalConfig, EvalReport, evaluate
from megatron_rl.quickstart.model import TinyModelConfig, build_model_folder
from megatron_rl.quickstart.problems import ProblemConfig, generate_problems, split_problems
from megatron_rl.quickstart.sft import SFTConfig, format_trace, run_sft
from megatron_rl.quickstart.tokenizer import QUICKSTART_PROMPT, build_tokenizer, load_tokenizer
from megatron_rl.rewards.compose import RewardConfig
from megatron_rl.rewards.format import check_think_tags
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS, MATH_INSTRUCTION, fill_think_tags

__all__ = ["WarmupResult", "main", "run_warmup"]


@dataclass
class WarmupResult:
    paths: dict[str, Path]  # train, held_out, tokenizer, init, sft
    eval: EvalReport  # held-out evaluation of the SFT model
    sft_losses: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # per stage, and total


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, flush=True)


def run_warmup(
    out_dir: str | os.PathLike,
    *,
    problems: ProblemConfig | None = None,
    model: TinyModelConfig | None = None,
    sft: SFTConfig | None = None,
    eval_cfg: EvalConfig | None = None,
    held_out_fraction: float = 0.1,
    eval_problems: int = 200,
    think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS,
    progress: bool = True,
) -> WarmupResult:
    """Build everything under ``out_dir`` and evaluate the SFT model on ``eval_problems``
    held-out problems (the first ones of the held-out split); see the module docstring.
    ``think_tags``: what the traces think between (the RL recipe's ``reward.think_tags``), one
    token each of the tokenizer."""
    check_think_tags(think_tags)
    tags = (think_tags[0], think_tags[1])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems, model = problems or ProblemConfig(), model or TinyModelConfig()
    sft, eval_cfg = (
        dataclasses.replace(sft or SFTConfig(), think_tags=tags),
        eval_cfg or EvalConfig(samples=2),
    )
    seconds: dict[str, float] = {}
    t0 = clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    train, held_out = split_problems(generate_problems(problems), held_out_fraction)
    paths = {name: out / f"{name}.jsonl" for name in ("train", "held_out")}
    for name, split in (("train", train), ("held_out", held_out)):
        write_problems(paths[name], (p.to_record() for p in split))
    _log(progress, f"[1/5] problems: {len(train)} train, {len(held_out)} held out")
    prompt = fill_think_tags(QUICKSTART_PROMPT, tags)
    corpus = [prompt, MATH_INSTRUCTION]
    for p in train:
        corpus += [p.problem, format_trace(p, think_tags=tags), format_trace(p, slip="0", think_tags=tags)]
    paths["tokenizer"] = build_tokenizer(corpus, out / "tokenizer", think_tags=tags)
    tokenizer = load_tokenizer(paths["tokenizer"])
    lap("data_and_tokenizer")
    _log(progress, f"[2/5] tokenizer: {len(tokenizer)} tokens")
    paths["init"] = build_model_folder(model, paths["tokenizer"], out / "init")
    lap("model")
    _log(progress, f"[3/5] model: {paths['init']}")
    result = run_sft(paths["init"], train, out / "sft", sft, progress=progress)
    paths["sft"] = result.folder
    lap("sft")
    _log(progress, f"[4/5] sft: {sft.steps} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    generator = LocalGenerator.from_pretrained(paths["sft"], max_slots=64, max_len=model.max_positions)
    report = evaluate(
        generator,
        tokenizer,
        held_out[:eval_problems],
        eval_cfg,
        reward_cfg=RewardConfig(think_tags=list(tags)),
        system_prompt=prompt,
        progress=progress,
    )
    lap("eval")
    seconds["total"] = time.perf_counter() - t0
    _log(progress, f"[5/5] held-out: {report.summary()}  ({seconds['total']:.0f} s in all)")
    # Written last and atomically: its presence tells `megatron-rl quickstart` to reuse the warm-up.
    atomic_write_json(
        out / "warmup.json",
        {
            "paths": {k: str(v) for k, v in paths.items()},
            "seconds": seconds,
            "eval": {k: v for k, v in dataclasses.asdict(report).items() if k != "examples"},
            "sft_loss_first_last": [result.losses[0], result.losses[-1]],
            "think_tags": list(tags),
        },
    )
    return WarmupResult(paths=paths, eval=report, sft_losses=result.losses, seconds=seconds)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m megatron_rl.quickstart.warmup", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--sft-steps", type=int_arg(1), default=SFTConfig().steps)
    parser.add_argument("--slip-rate", type=float_arg(0.0, 1.0), default=SFTConfig().slip_rate)
    parser.add_argument("--eval-problems", type=int_arg(1), default=200)
    parser.add_argument(
        "--think-tags",
        nargs=2,
        metavar=("OPEN", "CLOSE"),
        default=list(DEFAULT_THINK_TAGS),
        help="what the traces think between (reward.think_tags), e.g. [THINK] [/THINK]",
    )
    args = parser.parse_args(argv)
    run_warmup(
        args.out,
        sft=SFTConfig(steps=args.sft_steps, slip_rate=args.slip_rate),
        eval_problems=args.eval_problems,
        think_tags=args.think_tags,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl warmup", main))
