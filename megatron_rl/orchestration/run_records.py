"""The run directory's files other than the checkpoints, written as
:mod:`megatron_rl.orchestration.run` (which lays the directory out) calls for them: the recipe's
snapshot ``config.yaml``, checked against the checkpoint's on resume; each step's ``ledger.jsonl``
and ``samples.jsonl`` lines (the latter's schema is :mod:`megatron_rl.data.rundir`'s); the
step-by-step JSONL files cut back to the checkpoint's step when a run resumes; and the plots of
``metrics.jsonl``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import yaml

from megatron_rl.config import config_to_dict
from megatron_rl.fileio import append_jsonl, atomic_path, atomic_write_text, read_jsonl, truncate_jsonl

if TYPE_CHECKING:
    from pathlib import Path

    from megatron_rl.config import YamlValue
    from megatron_rl.fileio import JsonValue
    from megatron_rl.orchestration.group_record import GroupRecord
    from megatron_rl.orchestration.loop import StepResult
    from megatron_rl.orchestration.recipe import RunConfig

__all__ = [
    "check_resume_config",
    "cut_back",
    "plot_metrics",
    "snapshot_config",
    "write_samples",
]

# The files a resume cuts back to the checkpoint's step.
_STEP_FILES = ("metrics.jsonl", "samples.jsonl", "ledger.jsonl", "eval.jsonl")

_PLOTS = [
    ("reward/mean", "reward"),
    ("pass_rate", "pass rate (train)"),
    ("length/mean", "completion length"),
    ("train/entropy_mean", "entropy"),
    ("train/clip_high_frac", "clip-high fraction"),
    ("staleness/mean", "staleness"),
    ("generator/busy_fraction", "generator busy fraction"),
    ("throughput/generated_tokens_per_s", "generated tokens/s"),
]


# Fields a resumed run may not change: the checkpoint's prompts, seeds and groups depend on them
# (the data.* ones decide which problems the sampler's cursor walks; a field or any key under it).
_FIXED_ON_RESUME = (
    "model.hf",
    "data.train",
    "data.split",
    "data.columns",
    "data.where",
    "data.limit",
    "data.eval_fraction",
    "data.holdout_seed",
    "loop.group_size",
    "loop.seed",
    "data.shuffle",
)


def snapshot_config(run_dir: Path, cfg: RunConfig, *, resuming: bool) -> dict[str, YamlValue]:
    """Write ``config.yaml``, the resolved recipe (its API key masked), and return it; a resumed
    run's first is checked against the snapshot already there (:func:`check_resume_config`)."""
    snapshot = config_to_dict(cfg)
    fleet = snapshot["fleet"]
    if fleet["api_key"]:  # a secret: config.yaml says only that the recipe set one
        fleet["api_key"] = "<set>"
    if resuming:
        check_resume_config(run_dir / "config.yaml", snapshot)
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(snapshot, sort_keys=False))
    return snapshot


def check_resume_config(path: Path, new: dict[str, YamlValue]) -> None:
    """Refuse a resume whose recipe changed what the checkpoint's state depends on; say which
    other fields changed."""
    if not path.exists():
        return
    old = yaml.safe_load(path.read_text()) or {}

    def flat(d: dict[str, YamlValue], prefix: str = "") -> dict[str, YamlValue]:
        out: dict[str, YamlValue] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old), flat(new)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    fixed = [k for k in changed if any(k == f or k.startswith(f"{f}.") for f in _FIXED_ON_RESUME)]
    if fixed:
        raise ValueError(
            f"{path}: resuming with a different {fixed[0]} ({a.get(fixed[0])!r} -> "
            f"{b.get(fixed[0])!r}); use a new run.dir or run.resume=never"
        )
    if changed:
        print(f"[resume] recipe fields changed since the checkpoint: {', '.join(changed)}", file=sys.stderr)


def cut_back(run_dir: Path, step: int, *, metrics_tail: list[dict[str, JsonValue]]) -> None:
    """Cut the step-by-step JSONL files back to ``step`` (a resumed run's checkpoint); a line
    torn by a crash or a full disk is removed, and ``metrics.jsonl``'s records since the
    checkpoint before (``metrics_tail``, kept whole by the checkpoint) are written again."""
    saved = {"metrics.jsonl": metrics_tail}
    for name in _STEP_FILES:
        cut = truncate_jsonl(
            run_dir / name,
            lambda r: r.get("step") is None or r["step"] <= step,
            restore=saved.get(name, ()),
        )
        if cut.torn:
            again = (
                f"; step {', '.join(f'{s:g}' for s in cut.restored)} rewritten from the checkpoint"
                * bool(cut.restored)
            )
            print(
                f"[resume] {run_dir / name}: line {', '.join(map(str, cut.torn))} torn (cut by a "
                f"crash or a full disk) and removed{again}",
                file=sys.stderr,
            )


def write_samples(run_dir: Path, result: StepResult, dropped: list[GroupRecord], *, samples: bool) -> None:
    """``ledger.jsonl`` (one line per group trained or dropped at the step of ``result``) and, with
    ``samples``, ``samples.jsonl`` (every completion of those groups)."""
    step = result.step
    ledger = [
        {
            "step": step,
            "prompt_id": g.problem.id,
            "epoch": g.epoch,
            "index": g.index,
            "event": "trained",
            "issued_version": g.issued_version,
        }
        for g in result.groups
    ]
    ledger += [
        {
            "step": step,
            "prompt_id": g.problem.id,
            "epoch": g.epoch,
            "index": g.index,
            "event": "dropped",
            "reason": g.drop_reason,
        }
        for g in dropped
    ]
    append_jsonl(run_dir / "ledger.jsonl", ledger)
    if not samples:
        return
    rows = []
    for g in (*result.groups, *dropped):
        for s in g.all_scored():
            c = s.completion
            row: dict[str, JsonValue] = {
                "step": step,
                "prompt_id": g.problem.id,
                "problem": g.problem.problem,
                "task": g.problem.task,
                "prompt_ids": g.prompt_ids if c.prompt_ids is None else c.prompt_ids,
                "completion_ids": c.token_ids,
                "completion": c.text,
                "reward": s.reward,
                "parts": s.parts,
                "reason": s.reason,
                "correct": s.correct,
                "versions": c.versions,
            }
            if c.loss_mask is not None:  # a multi-turn trajectory (data/rundir.py's schema)
                row["loss_mask"] = c.loss_mask
            rows.append(row)
    append_jsonl(run_dir / "samples.jsonl", rows)


def plot_metrics(metrics_path: Path, evals: list[dict[str, JsonValue]], out_dir: Path) -> list[Path]:
    """PNG plots of the run's metrics against step (and held-out pass@1 when evaluated)."""
    import matplotlib  # lazy: matplotlib is heavy; only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy; only plotting needs it

    rows = read_jsonl(metrics_path, cut_tail="warn")
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = [(k, t) for k, t in _PLOTS if any(k in r for r in rows)]
    if not rows or not keys:
        return []
    cols = 2
    fig, axes = plt.subplots(
        (len(keys) + 1 + cols - 1) // cols, cols, figsize=(10, 2.6 * ((len(keys) + 2) // cols)), squeeze=False
    )
    for ax, (k, title) in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker=".", ms=2, lw=0.6, alpha=0.45, color="C0")
        if len(ys) >= 10:  # per-step values are noisy: a trailing mean shows the trend
            w = max(5, len(ys) // 20)
            ax.plot(
                xs,
                [
                    sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1])
                    for i in range(len(ys))
                ],
                lw=1.8,
                color="C1",
                label=f"mean of {w}",
            )
            ax.legend(fontsize=7, loc="best")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes.flat[len(keys)]
    evals = [e for e in evals if e.get("pass@1") is not None]  # an evaluation cut before any sample
    if evals:
        ax.plot([e["step"] for e in evals], [e["pass@1"] for e in evals], marker="o")
        ax.set_title("held-out pass@1", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for extra in list(axes.flat)[len(keys) + 1 :]:
        extra.axis("off")
    fig.tight_layout()
    path = out_dir / "training.png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return [path]
