"""Every PNG the curation, evaluation and analysis tools draw (matplotlib, Agg backend: no display
needed). Each function takes plain numbers and a path, and writes the file atomically."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from megatron_rl.fileio import atomic_path

__all__ = [
    "ablation_plot",
    "language_bars",
    "length_histogram",
    "pass_at_k_curve",
    "pass_rate_histogram",
    "reward_length_plot",
    "stage_bars",
    "trajectory_plot",
]


def _pyplot():
    try:
        import matplotlib  # lazy: matplotlib is heavy; only plotting needs it
    except ImportError:
        raise RuntimeError("plots need matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy; only plotting needs it

    return plt


def _save(fig, path: str | os.PathLike) -> None:
    plt = _pyplot()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def pass_rate_histogram(
    rates: Sequence[float],
    path,
    *,
    low: float,
    high: float,
    samples: int | None = None,
    title: str = "Pass rate per problem",
) -> None:
    """Histogram of per-problem pass rates with the kept interval (low, high) shaded. With a
    common sample count k, one bar per possible rate 0/k .. k/k."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = [(i - 0.5) / samples for i in range(samples + 2)] if samples else [i / 20 for i in range(21)]
    ax.hist(list(rates), bins=bins, color="#4477aa", edgecolor="white")
    ax.axvspan(low, high, color="#66aa55", alpha=0.12, label=f"kept: {low:g} < rate < {high:g}")
    ax.set_xlabel("pass rate" + (f" (of {samples} samples)" if samples else ""))
    ax.set_ylabel("problems")
    ax.set_title(f"{title} ({len(rates)} problems)")
    ax.legend(loc="upper center")
    _save(fig, path)


def pass_at_k_curve(
    ks: Sequence[int], curves: Mapping[str, Sequence[float]], path, *, title: str = "pass@k"
) -> None:
    """pass@k against k (log2 axis), one line per label (e.g. per task or language)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(list(ks), list(values), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ks), [str(k) for k in ks])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def length_histogram(
    correct: Sequence[int], wrong: Sequence[int], path, *, title: str = "Completion length"
) -> None:
    """Completion lengths (tokens) of correct and incorrect samples, overlaid."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    both = list(correct) + list(wrong)
    top = max(both) if both else 1
    bins = [top * i / 30 for i in range(31)] if top > 0 else [0, 1]
    ax.hist(
        [list(correct), list(wrong)],
        bins=bins,
        label=[f"correct ({len(correct)})", f"incorrect ({len(wrong)})"],
        color=["#66aa55", "#cc6677"],
        stacked=True,
    )
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("samples")
    ax.set_title(title)
    ax.legend()
    _save(fig, path)


def language_bars(
    values: Mapping[str, float], path, *, metric: str = "pass@1", title: str = "Results per language"
) -> None:
    """One bar per language."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(values) + 2), 4))
    names = list(values)
    ax.bar(names, [values[n] for n in names], color="#4477aa")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel(metric)
    ax.set_title(title)
    _save(fig, path)


def stage_bars(
    values: Mapping[str, float],
    errors: Mapping[str, float | None],
    path,
    *,
    metric: str = "held-out pass@1",
    title: str = "",
) -> None:
    """One bar per stage of a pipeline (e.g. base, SFT, RL), in the mapping's order, each with its
    standard error as an error bar (none where ``errors`` has None) and its value written above."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(values) + 2), 4))
    names = list(values)
    heights = [values[n] for n in names]
    yerr = [errors.get(n) or 0.0 for n in names]
    ax.bar(names, heights, yerr=yerr, capsize=6, color="#4477aa")
    for i, (h, e) in enumerate(zip(heights, yerr)):
        ax.text(i, h + e + 0.01, f"{h:.3f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, min(1.02, max(heights + [0.0]) + max(yerr + [0.0]) + 0.12))
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    _save(fig, path)


def reward_length_plot(
    lengths: Sequence[float],
    rewards: Sequence[float],
    steps: Sequence[int],
    a: float,
    b: float,
    path,
    *,
    r2: float,
) -> None:
    """Reward (without the length penalty) against mean completion length, coloured by step, with
    the fit ``reward = a + b ln(length)`` (Magistral, Figure 9)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sc = ax.scatter(list(lengths), list(rewards), c=list(steps), cmap="viridis", s=18)
    fig.colorbar(sc, ax=ax, label="step")
    lo, hi = min(lengths), max(lengths)
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)] if lo > 0 else []
    if xs:
        ax.plot(
            xs,
            [a + b * math.log(x) for x in xs],
            color="#cc3311",
            label=f"{a:.3f} + {b:.3f} ln(length),  R² = {r2:.3f}",
        )
        ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("mean completion length (tokens)")
    ax.set_ylabel("reward without length penalty")
    ax.set_title("Reward against completion length")
    _save(fig, path)


def trajectory_plot(
    coords: Sequence[Sequence[float]], labels: Sequence[str], explained: Sequence[float], path
) -> None:
    """Checkpoints in the plane of the first two principal components, joined in order
    (Magistral, Figure 8)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    xs = [c[0] for c in coords]
    ys = [c[1] if len(c) > 1 else 0.0 for c in coords]
    ax.plot(xs, ys, color="#999999", zorder=1)
    sc = ax.scatter(xs, ys, c=list(range(len(xs))), cmap="viridis", zorder=2)
    for x, y, label in zip(xs, ys, labels):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(f"PC1 ({100 * explained[0]:.1f}% of variance)")
    ax.set_ylabel(f"PC2 ({100 * explained[1]:.1f}% of variance)" if len(explained) > 1 else "PC2")
    ax.set_title("Weight trajectory across checkpoints")
    fig.colorbar(sc, ax=ax, label="checkpoint order")
    _save(fig, path)


def ablation_plot(arms: Mapping[str, Sequence[Mapping[str, object]]], path, *, title: str = "") -> None:
    """What asynchrony costs, per arm: held-out pass@1 against the samples trained and against
    the training wall time (mean over seeds at each evaluation, with its standard error as a band
    when there are several), and the staleness histogram (fraction of trained tokens per lag).

    ``arms``: arm name -> its seeds' records, each with ``curve`` (``[{"samples", "wall_s",
    "pass1"}]``, evaluations at the same steps in every seed) and ``staleness_hist`` (``{lag:
    tokens}``, keys as strings or ints)."""
    plt = _pyplot()
    fig, (ax_s, ax_t, ax_h) = plt.subplots(1, 3, figsize=(17, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n_arms = max(1, len(arms))
    width = 0.8 / n_arms
    for i, (arm, recs) in enumerate(arms.items()):
        color = colors[i % len(colors)]
        curves = [list(r["curve"]) for r in recs]  # type: ignore[call-overload]
        n = min(len(c) for c in curves) if curves else 0
        xs_s = [float(curves[0][j]["samples"]) for j in range(n)]
        xs_t = [sum(float(c[j]["wall_s"]) for c in curves) / len(curves) for j in range(n)]
        ys, ses = [], []
        for j in range(n):
            vals = [float(c[j]["pass1"]) for c in curves]
            mean = sum(vals) / len(vals)
            ys.append(mean)
            var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
            ses.append(math.sqrt(var / len(vals)))
        label = f"{arm} ({len(recs)} seed{'s' if len(recs) != 1 else ''})"
        for ax, xs in ((ax_s, xs_s), (ax_t, xs_t)):
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=label)
            if len(recs) > 1:
                ax.fill_between(
                    xs,
                    [y - e for y, e in zip(ys, ses)],
                    [y + e for y, e in zip(ys, ses)],
                    color=color,
                    alpha=0.15,
                )
        hist: dict[int, float] = {}
        for r in recs:
            for k, v in dict(r["staleness_hist"]).items():  # type: ignore[call-overload]
                hist[int(k)] = hist.get(int(k), 0.0) + float(v)
        total = sum(hist.values()) or 1.0
        lags = sorted(hist)
        ax_h.bar(
            [k - 0.4 + width * (i + 0.5) for k in lags],
            [hist[k] / total for k in lags],
            width=width,
            color=color,
            label=arm,
        )
    ax_s.set_xlabel("samples trained")
    ax_t.set_xlabel("training wall time (s)")
    for ax in (ax_s, ax_t):
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=8)
    ax_h.set_xlabel("policy versions behind, per trained token")
    ax_h.set_ylabel("fraction of trained tokens")
    ax_h.set_yscale("log")
    ax_h.legend(fontsize=8)
    ax_s.set_title("at equal samples")
    ax_t.set_title("at equal wall time")
    ax_h.set_title("staleness")
    if title:
        fig.suptitle(title, fontsize=10)
    _save(fig, path)
