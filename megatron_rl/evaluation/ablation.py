"""What asynchrony costs: one arm-and-seed run of ``megatron-rl ablate async`` read back from its
run folder, the arms summarised over seeds, and the Markdown table.

A run folder is what ``megatron-rl train`` writes (``metrics.jsonl``, ``eval.jsonl``,
``summary.json``). From it:

- **the eval curve**: held-out pass@1 at each evaluation, against the samples trained so far
  (``step * n_minibatch``) and against the *training wall time*: the sum of the steps' durations
  (``time/step_s``: from one step's end to the next's, so generation, training, the weight update
  and checkpoints), less the evaluations that ran between two steps. Start-up, the first
  evaluation and the process restarts of a resumed run are not in it, so arms compare on what
  asynchrony changes.
- **staleness**: per trained token, how many policy versions behind the weights that trained it
  it was generated (``staleness/hist/*`` x ``staleness/tokens`` of every step, pooled): mean, p95
  and the histogram.
- **pass@1 at equal wall time**: the curve read (linearly between evaluations) at a time every
  arm of the seed reached -- the shortest arm's training wall time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.errors import InputError
from megatron_rl.fileio import JsonValue, loads_json, read_jsonl

__all__ = [
    "RECORD_FIELDS",
    "ArmRun",
    "curve_at",
    "markdown_table",
    "read_arm_run",
    "summarize_arms",
]

#: The fields of every ``results.json`` record (the issue's list, in its order; more follow).
RECORD_FIELDS = (
    "arm",
    "mode",
    "ratio",
    "minibatch_ratio",
    "objective",
    "seed",
    "steps",
    "pass1_before",
    "pass1_after",
    "pass1_equal_wall",
    "wall_equal_s",
    "staleness_mean",
    "staleness_p95",
    "wall_s",
)


@dataclass
class ArmRun:
    """One finished run of an arm: what ``results.json`` keeps of it."""

    steps: int  # optimizer steps (policy versions)
    samples_per_step: int
    pass1_before: float
    pass1_after: float
    wall_s: float  # training wall time (see the module docstring)
    curve: list[dict[str, float]]  # {"step", "samples", "wall_s", "pass1"}, from step 0
    staleness: dict[int, int]  # lag -> tokens

    @property
    def staleness_tokens(self) -> int:
        return sum(self.staleness.values())

    def staleness_mean(self) -> float:
        n = self.staleness_tokens
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0

    def staleness_quantile(self, q: float) -> float:
        """The smallest lag at or above a fraction ``q`` of the tokens."""
        n = self.staleness_tokens
        need, seen = max(1, math.ceil(q * n)), 0
        for k in sorted(self.staleness):
            seen += self.staleness[k]
            if seen >= need:
                return float(k)
        return 0.0


def _number(rec: dict[str, JsonValue], key: str, where: str) -> float:
    value = rec.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InputError(f"{where}: field {key!r} is {value!r}, not a finite number")
    return float(value)


def read_arm_run(run_dir: Path, samples_per_step: int) -> ArmRun:
    """The finished run in ``run_dir``, which trained ``samples_per_step`` sequences per optimizer
    step (``n_minibatch``); InputError naming the file when a part is missing."""
    summary_path = run_dir / "summary.json"
    try:
        summary = loads_json(summary_path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{summary_path}: cannot read the run's summary ({err})") from None
    if not isinstance(summary, dict):
        raise InputError(f"{summary_path}: not a JSON object")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").exists() else []
    eval_s: dict[int, float] = {}  # evaluation seconds after the record of step k
    points: dict[int, float] = {}
    for i, e in enumerate(evals, 1):
        where = f"{run_dir / 'eval.jsonl'}: line {i}"
        step = int(_number(e, "step", where))
        eval_s[step] = eval_s.get(step, 0.0) + _number(e, "seconds", where)
        if not e.get("partial"):
            points[step] = _number(e, "pass@1", where)  # the latest evaluation of a step counts
    wall = 0.0
    walls = {0: 0.0}
    hist: Counter[int] = Counter()
    for i, m in enumerate(metrics, 1):
        where = f"{run_dir / 'metrics.jsonl'}: line {i}"
        step = int(_number(m, "step", where))
        # the evaluation after the previous step's record ran inside this step's duration
        wall += max(0.0, _number(m, "time/step_s", where) - eval_s.pop(step - 1, 0.0))
        walls[step] = wall
        tokens = m.get("staleness/tokens")
        if isinstance(tokens, (int, float)):
            for key, frac in m.items():
                if key.startswith("staleness/hist/") and isinstance(frac, (int, float)):
                    hist[int(key.rsplit("/", 1)[1])] += round(float(frac) * float(tokens))
    steps = int(_number(summary, "steps", str(summary_path)))
    if 0 not in points or steps not in points:
        raise InputError(
            f"{run_dir / 'eval.jsonl'}: needs a complete evaluation at step 0 and at step {steps} "
            f"(has {sorted(points)}); run the arm again to finish it"
        )
    curve = [
        {
            "step": float(k),
            "samples": float(k * samples_per_step),
            "wall_s": walls.get(k, math.nan),
            "pass1": v,
        }
        for k, v in sorted(points.items())
        if k in walls
    ]
    return ArmRun(
        steps=steps,
        samples_per_step=samples_per_step,
        pass1_before=points[0],
        pass1_after=points[steps],
        wall_s=walls.get(steps, wall),
        curve=curve,
        staleness=dict(sorted(hist.items())),
    )


def curve_at(curve: Sequence[dict[str, float]], wall_s: float) -> float:
    """pass@1 of ``curve`` at training wall time ``wall_s``: linear between its evaluations,
    its last value past its end."""
    pts = sorted((p["wall_s"], p["pass1"]) for p in curve if math.isfinite(p["wall_s"]))
    if not pts:
        return math.nan
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= wall_s <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (wall_s - t0) / (t1 - t0)
    return pts[0][1] if wall_s < pts[0][0] else pts[-1][1]


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return math.nan, None
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var / len(vals))


def summarize_arms(records: list[dict[str, JsonValue]]) -> list[dict[str, JsonValue]]:
    """Per arm (in the order arms first appear): seeds, and mean and standard error over seeds
    of pass@1 before / after / at equal wall time, staleness mean and p95, wall time."""
    arms: dict[str, list[dict[str, JsonValue]]] = {}
    for rec in records:
        arms.setdefault(str(rec["arm"]), []).append(rec)
    out: list[dict[str, JsonValue]] = []
    for arm, recs in arms.items():
        row: dict[str, JsonValue] = {
            "arm": arm,
            **{k: recs[0][k] for k in ("mode", "ratio", "minibatch_ratio", "objective")},
            "seeds": len(recs),
        }
        for key in (
            "pass1_before",
            "pass1_after",
            "pass1_equal_wall",
            "staleness_mean",
            "staleness_p95",
            "wall_s",
        ):
            mean, se = _mean_se([float(r[key]) for r in recs if isinstance(r.get(key), (int, float))])
            row[key] = mean
            row[key + "_se"] = se
        out.append(row)
    return out


def _fmt(mean: JsonValue, se: JsonValue, digits: int) -> str:
    if not isinstance(mean, (int, float)) or not math.isfinite(mean):
        return "-"
    text = f"{mean:.{digits}f}"
    return text + (f" ± {se:.{digits}f}" if isinstance(se, (int, float)) else "")


def markdown_table(summary: list[dict[str, JsonValue]]) -> str:
    """The arms as a Markdown table (mean ± standard error over seeds)."""
    lines = [
        "| arm | loop | n_async / n_batch | n_minibatch / n_batch | objective | seeds | pass@1 before "
        "| pass@1 after (equal samples) | pass@1 at equal wall time | staleness mean | staleness p95 "
        "| training wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        ratio = r["ratio"]
        lines.append(
            f"| {r['arm']} | {r['mode']} | {'-' if ratio is None else f'{ratio:g}'} "
            f"| {r['minibatch_ratio']} | {r['objective']} | {r['seeds']} "
            f"| {_fmt(r['pass1_before'], r['pass1_before_se'], 3)} "
            f"| {_fmt(r['pass1_after'], r['pass1_after_se'], 3)} "
            f"| {_fmt(r['pass1_equal_wall'], r['pass1_equal_wall_se'], 3)} "
            f"| {_fmt(r['staleness_mean'], r['staleness_mean_se'], 2)} "
            f"| {_fmt(r['staleness_p95'], r['staleness_p95_se'], 1)} "
            f"| {_fmt(r['wall_s'], r['wall_s_se'], 0)} |"
        )
    return "\n".join(lines) + "\n"
