"""``megatron-rl ablate async``: what asynchrony costs, measured.

    megatron-rl ablate async --out runs/ablate [--ratios 1,2,4] [--seeds 3] [--steps 100]
                             [--recipe examples/quickstart.yaml] [--arms sync,async-r4] [k=v ...]

One recipe (default: the quick start's, on its SFT warm-up, which every arm shares) run as a grid
of arms, each with ``--seeds`` seeds (``loop.seed`` and ``trainer.seed``; every arm of a seed sees
the same prompts in the same order) for ``--steps`` steps of ``n_batch`` sequences, so every arm
trains on the same number of samples:

- ``sync``: ``loop.mode: sync``, the on-policy baseline (staleness 0);
- ``async-rR`` for each ratio R of ``--ratios``: ``loop.mode: async`` with ``n_async = R *
  n_batch`` (``max_async_ratio`` raised to R);
- ``async-r2-mb4``: the paper's Figure 6b variant, ``n_minibatch = n_batch / 4`` at ratio 2 (four
  optimizer steps a batch: later minibatches are off-policy even in sync);
- ``decoupled-rR`` (R the largest ratio): the async arm with ``algorithm.objective: decoupled``
  (AReaL's decoupled PPO), the one mitigation tested.

Every arm gets the same fleet (``fleet.max_slots`` raised to hold the largest ``n_async``, so the
ratio, not the KV capacity, decides what is in flight). Each arm-and-seed is a ``megatron-rl
train`` run in ``OUT/runs/ARM/seedS`` (its output in ``OUT/runs/ARM/seedS.log``); running the
command again skips the finished ones and resumes an interrupted one from its checkpoint. After
each, ``OUT/results.json`` (one record per arm and seed), ``OUT/results.md`` (the table, mean ±
standard error over seeds) and ``OUT/ablation.png`` are rewritten, so a partial grid is readable.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.errors import ArgumentParser, OutputError, RunStopped, UsageError, int_arg, run_cli
from megatron_rl.evaluation.ablation import (
    RECORD_FIELDS,
    curve_at,
    markdown_table,
    read_arm_run,
    summarize_arms,
)
from megatron_rl.evaluation.plots import ablation_plot
from megatron_rl.fileio import JsonValue, atomic_write_json, atomic_write_text, check_output_apart, loads_json
from megatron_rl.orchestration.recipe import RunConfig, load_config
from megatron_rl.quickstart.pipeline import DEFAULT_RECIPE, ensure_warmup
from megatron_rl.quickstart.stages import train_command

__all__ = ["Arm", "main", "plan_arms"]

FIG6B_RATIO = 2  # the paper's Figure 6b variant runs at n_async / n_batch = 2 ...
FIG6B_MINIBATCHES = 4  # ... with n_minibatch = n_batch / 4


@dataclass(frozen=True)
class Arm:
    """One arm of the grid and the recipe overrides that make it."""

    name: str
    mode: str  # "sync" | "async"
    ratio: float | None  # n_async / n_batch (None: sync)
    minibatches: int  # optimizer steps per batch (n_batch / n_minibatch)
    objective: str  # "magistral" | "decoupled"

    def overrides(self, cfg: RunConfig) -> list[str]:
        n_batch = cfg.loop.n_batch
        out = [f"loop.mode={self.mode}", f"loop.n_minibatch={n_batch // self.minibatches}"]
        if self.ratio is not None:
            out += [f"loop.n_async={int(self.ratio * n_batch)}", f"loop.max_async_ratio={self.ratio:g}"]
        return [*out, f"algorithm.objective={self.objective}"]


def plan_arms(ratios: list[float], cfg: RunConfig) -> list[Arm]:
    """The grid: sync, async at each ratio, Figure 6b's variant, the decoupled objective at the
    largest ratio. ConfigError when the recipe's sizes cannot make an arm."""
    g, n_batch = cfg.loop.group_size, cfg.loop.n_batch
    arms = [Arm("sync", "sync", None, 1, "magistral")]
    for r in ratios:
        arms.append(Arm(f"async-r{r:g}", "async", r, 1, "magistral"))
    arms.append(
        Arm(
            f"async-r{FIG6B_RATIO}-mb{FIG6B_MINIBATCHES}",
            "async",
            FIG6B_RATIO,
            FIG6B_MINIBATCHES,
            "magistral",
        )
    )
    arms.append(Arm(f"decoupled-r{max(ratios):g}", "async", max(ratios), 1, "decoupled"))
    for arm in arms:
        if arm.ratio is not None and (arm.ratio * n_batch) % g:
            raise UsageError(
                f"--ratios: {arm.ratio:g} x loop.n_batch ({n_batch}) is not a whole number of groups of "
                f"loop.group_size ({g}); arm {arm.name} needs it"
            )
        if n_batch % (arm.minibatches * g):
            raise UsageError(
                f"arm {arm.name}: loop.n_batch ({n_batch}) / {arm.minibatches} minibatches is not a "
                f"multiple of loop.group_size ({g})"
            )
    return arms


def _ratios(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ratios {text!r}: expected numbers separated by commas, e.g. 1,2,4") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise UsageError(f"--ratios {text!r}: expected positive numbers separated by commas, e.g. 1,2,4")
    return sorted(set(values))


def _finished(run_dir: Path, steps: int) -> bool:
    """Whether the arm's run finished its ``steps`` optimizer steps (summary.json written at its
    end)."""
    try:
        summary = loads_json((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(summary, dict) or summary.get("stopped") != "max_steps":
        return False
    done = summary.get("steps")
    if isinstance(done, int) and done > steps:
        raise OutputError(
            f"{run_dir}: this arm ran {done} optimizer steps, more than the {steps} it takes now; use another --out "
            f"(or the same --steps) so that every arm trains on the same samples"
        )
    return done == steps


def _run_arm(cmd: list[str], log: Path) -> int:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def _record(arm: Arm, seed: int, run_dir: Path, n_batch: int) -> dict[str, JsonValue]:
    run = read_arm_run(run_dir, n_batch // arm.minibatches)
    return {
        "arm": arm.name,
        "mode": arm.mode,
        "ratio": arm.ratio,
        "minibatch_ratio": 1.0 / arm.minibatches,
        "objective": arm.objective,
        "seed": seed,
        "steps": run.steps // arm.minibatches,  # batches of n_batch samples
        "optimizer_steps": run.steps,
        "samples": run.steps * (n_batch // arm.minibatches),
        "pass1_before": run.pass1_before,
        "pass1_after": run.pass1_after,
        "staleness_mean": run.staleness_mean(),
        "staleness_p95": run.staleness_quantile(0.95),
        "staleness_tokens": run.staleness_tokens,
        "staleness_hist": {str(k): v for k, v in run.staleness.items()},
        "wall_s": run.wall_s,
        "curve": run.curve,
        "run_dir": str(run_dir),
    }


def _equal_wall(records: list[dict[str, JsonValue]]) -> None:
    """``pass1_equal_wall`` / ``wall_equal_s``: each record's curve at the shortest training wall
    time among the arms of its seed."""
    for seed in {r["seed"] for r in records}:
        same = [r for r in records if r["seed"] == seed]
        t = min(float(r["wall_s"]) for r in same)
        for r in same:
            r["wall_equal_s"] = t
            r["pass1_equal_wall"] = curve_at(r["curve"], t)


def _write_results(
    out: Path, records: list[dict[str, JsonValue]], title: str
) -> tuple[str, list[dict[str, JsonValue]]]:
    """results.json, results.md and ablation.png of the records so far; the table and the
    per-arm summary."""
    _equal_wall(records)
    ordered = [{**{k: r.get(k) for k in RECORD_FIELDS}, **r} for r in records]
    atomic_write_json(out / "results.json", ordered)
    summary = summarize_arms(ordered)
    table = markdown_table(summary)
    atomic_write_text(out / "results.md", f"{title}\n\n{table}")
    arms: dict[str, list[dict[str, JsonValue]]] = {}
    for r in ordered:
        arms.setdefault(str(r["arm"]), []).append(r)
    ablation_plot(arms, out / "ablation.png", title=title)
    return table, summary


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="megatron-rl ablate", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["async"], help="what to ablate (async: the loop's asynchrony)")
    p.add_argument("--out", required=True, help="output folder (reused to resume)")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="the RL recipe (default: the quick start's)")
    p.add_argument("--ratios", default="1,2,4", help="n_async / n_batch of the async arms (default 1,2,4)")
    p.add_argument("--seeds", type=int_arg(1), default=3, help="seeds per arm (default 3)")
    p.add_argument("--steps", type=int_arg(1), default=100, help="training steps per arm (default 100)")
    p.add_argument(
        "--evals", type=int_arg(1), default=5, help="held-out evaluations per arm after step 0 (default 5)"
    )
    p.add_argument("--arms", default="", help="run only these arms (names, comma-separated; default all)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for every arm, e.g. run.eval_samples=100")
    args = p.parse_intermixed_args(argv)
    for name in ("seeds", "steps", "evals"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    out = Path(args.out).absolute()
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file; the ablation writes a folder there")
    for written in (
        out / "warmup",
        out / "runs",
        out / "results.json",
        out / "results.md",
        out / "ablation.png",
    ):
        check_output_apart(written, [args.recipe], what="the ablation's output")
    cfg = load_config(args.recipe, args.overrides)
    arms = plan_arms(_ratios(args.ratios), cfg)
    if args.arms:
        wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = [a for a in wanted if a not in {arm.name for arm in arms}]
        if unknown:
            raise UsageError(
                f"--arms: no arm {unknown[0]!r}; the grid's arms are {', '.join(a.name for a in arms)}"
            )
        arms = [a for a in arms if a.name in wanted]
    n_batch = cfg.loop.n_batch
    slots = max(cfg.fleet.max_slots, *(math.ceil(a.ratio * n_batch) for a in arms if a.ratio is not None), 1)
    eval_every = max(1, args.steps // args.evals)
    out.mkdir(parents=True, exist_ok=True)
    warmup = ensure_warmup(out / "warmup", list(cfg.reward.think_tags))
    paths = warmup["paths"]
    title = (
        f"megatron-rl ablate async: {Path(args.recipe).name}, {args.steps} steps x {n_batch} samples, "
        f"G={cfg.loop.group_size}, fleet.max_slots={slots}, seeds {args.seeds}"
    )
    plan = [(seed, arm) for seed in range(args.seeds) for arm in arms]  # seed-major: whole seeds first
    records: list[dict[str, JsonValue]] = []
    table: str = ""  # the grid so far (the plan always has an arm)
    summary: list[dict[str, JsonValue]] = []
    t0 = time.monotonic()
    for i, (seed, arm) in enumerate(plan, 1):
        run_dir = out / "runs" / arm.name / f"seed{seed}"
        log = run_dir.parent / f"seed{seed}.log"
        head = f"[ablate {i}/{len(plan)}] {arm.name} seed {seed}"
        # loop.max_steps and run.eval_every count optimizer steps (policy versions): an arm with
        # several minibatches a batch takes as many more, on the same samples.
        versions = args.steps * arm.minibatches
        if not _finished(run_dir, versions):
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            print(f"{head}: training ({log})", file=sys.stderr, flush=True)
            cmd = train_command(
                args.recipe,
                paths,
                run_dir,
                [
                    f"loop.max_steps={versions}",
                    f"loop.seed={seed}",
                    f"trainer.seed={1234 + seed}",
                    f"run.eval_every={eval_every * arm.minibatches}",
                    "run.time_limit_min=0",
                    f"fleet.max_slots={slots}",
                    *args.overrides,
                    *arm.overrides(cfg),
                ],
            )
            rc = _run_arm(cmd, log)
            if rc or not _finished(run_dir, versions):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print("\n".join(tail), file=sys.stderr)
                raise RunStopped(
                    f"{head}: megatron-rl train exited {rc} before finishing (log: {log}); run the same "
                    f"command again to resume it"
                )
        rec = _record(arm, seed, run_dir, n_batch)
        records.append(rec)
        table, summary = _write_results(out, records, title)
        print(
            f"{head}: pass@1 {rec['pass1_before']:.3f} -> {rec['pass1_after']:.3f}, staleness mean "
            f"{rec['staleness_mean']:.2f} p95 {rec['staleness_p95']:.0f}, training {rec['wall_s']:.0f} s "
            f"({(time.monotonic() - t0) / 60:.1f} min so far)",
            file=sys.stderr,
            flush=True,
        )
    print(f"\n{title}\n\n{table}\n{out / 'results.json'}\n{out / 'ablation.png'}", file=sys.stderr)
    arms_json = {r["arm"]: r for r in summary}
    print(
        json.dumps(
            {"results": str(out / "results.json"), "plot": str(out / "ablation.png"), "arms": arms_json}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl ablate", main))
