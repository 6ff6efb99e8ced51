"""Analysis of a training run: reward against completion length (Magistral, Figure 9) and the
weight trajectory across checkpoints in PCA space (Figure 8).

    python -m megatron_rl.evaluation.analysis reward-length --metrics run/metrics.jsonl --out fig9.png
    python -m megatron_rl.evaluation.analysis weight-pca --checkpoints ckpt/step_*/ --out fig8.png

**Reward against length.** From a metrics JSONL (one object per step with ``step``,
``reward/mean``, ``reward/length_penalty`` -- the mean signed length part of the reward, <= 0 --
and ``length/mean``), the reward without the length penalty ``reward/mean - reward/length_penalty``
is fitted as ``a + b ln(length/mean)`` by least squares; the paper reports the reward growing
logarithmically with length.

**Weight trajectory.** The checkpoints (HF folders, safetensors) are flattened to vectors over the
tensors they share -- at most ``max_coords`` coordinates, drawn once at random (seeded) in
proportion to each tensor's size when there are more, the same coordinates in every checkpoint --
centred, and projected on their first two principal components. With C checkpoints of D
coordinates the PCA works on the C x C Gram matrix (eigendecomposition), never on a D x D one.
Both write a PNG and a JSON of the numbers next to it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from megatron_rl.data.problems import DataError, read_records
from megatron_rl.errors import ArgumentParser, int_arg, run_cli
from megatron_rl.evaluation import plots
from megatron_rl.fileio import atomic_write_json
from megatron_rl.hf.files import HFWeights

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["fit_log", "main", "read_metrics", "reward_length", "weight_pca"]


def read_metrics(path: str | os.PathLike[str], keys: Sequence[str]) -> list[dict[str, JsonValue]]:
    """Rows of a metrics JSONL that hold every key of ``keys`` (numbers); others are skipped
    (e.g. evaluation-only lines). A key present but not a number is an error naming the line."""
    rows: list[dict[str, JsonValue]] = []
    for where, obj in read_records(path):
        if not isinstance(obj, dict) or not all(k in obj for k in keys):
            continue
        for k in keys:
            if isinstance(obj[k], bool) or not isinstance(obj[k], (int, float)):
                raise DataError(f"{where}: {k}: expected a number, got {obj[k]!r}")
        rows.append(obj)
    return rows


def fit_log(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = a + b ln x``; returns a, b and R²."""
    if len(x) < 2 or any(v <= 0 for v in x):
        raise ValueError("fit_log: need two or more points with positive x")
    lx = [math.log(v) for v in x]
    mx, my = sum(lx) / len(lx), sum(y) / len(y)
    sxx = sum((v - mx) ** 2 for v in lx)
    if sxx == 0:
        raise ValueError("fit_log: every length is the same; nothing to fit")
    b = sum((u - mx) * (v - my) for u, v in zip(lx, y)) / sxx
    a = my - b * mx
    ss_tot = sum((v - my) ** 2 for v in y)
    ss_res = sum((v - a - b * u) ** 2 for u, v in zip(lx, y))
    return {"a": a, "b": b, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def reward_length(
    metrics: str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    *,
    reward_key: str = "reward/mean",
    penalty_key: str = "reward/length_penalty",
    length_key: str = "length/mean",
) -> dict[str, JsonValue]:
    """Fit and plot reward (length penalty removed) against mean length; returns the fit (the
    JSON written next to the PNG)."""
    rows = read_metrics(metrics, ("step", reward_key, penalty_key, length_key))
    if len(rows) < 2:
        raise DataError(f"{metrics}: fewer than two steps with {reward_key}, {penalty_key} and {length_key}")
    lengths = [float(r[length_key]) for r in rows]
    rewards = [float(r[reward_key]) - float(r[penalty_key]) for r in rows]
    fit = fit_log(lengths, rewards)
    plots.reward_length_plot(
        lengths, rewards, [int(r["step"]) for r in rows], fit["a"], fit["b"], out_png, r2=fit["r2"]
    )
    result = {**fit, "points": len(rows), "steps": [rows[0]["step"], rows[-1]["step"]]}
    atomic_write_json(Path(out_png).with_suffix(".json"), result)
    return result


def _label(folder: Path) -> str:
    numbers = re.findall(r"\d+", folder.name)
    return numbers[-1] if numbers else folder.name


def _coordinates(first: HFWeights, max_coords: int, seed: int) -> dict[str, torch.Tensor | None]:
    """Per tensor, the flat indices to take (None: all of it)."""
    sizes = {name: math.prod(first.shape(name)) for name in sorted(first)}
    total = sum(sizes.values())
    if total <= max_coords:
        return {name: None for name in sizes}
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor | None] = {}
    for name, size in sizes.items():
        take = max(1, round(max_coords * size / total))
        out[name] = torch.randint(0, size, (min(take, size),), generator=gen)
    return out


def weight_pca(
    folders: Sequence[str],
    out_png: str | os.PathLike[str],
    *,
    max_coords: int = 2_000_000,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, JsonValue]:
    """Project the checkpoints on the first two principal components; plot and return them (the
    JSON written next to the PNG)."""

    if len(folders) < 2:
        raise ValueError("weight-pca: give two or more checkpoints")
    weights = [HFWeights(f) for f in folders]
    names = set(weights[0])
    for f, w in zip(folders[1:], weights[1:]):
        if set(w) != names:
            diff = sorted(names ^ set(w))[:3]
            raise DataError(f"{f}: holds different tensors from {folders[0]} (e.g. {diff})")
        for n in names:
            if w.shape(n) != weights[0].shape(n):
                raise DataError(f"{f}: {n}: shape {w.shape(n)} differs from {weights[0].shape(n)}")
    picks = _coordinates(weights[0], max_coords, seed)
    rows: list[torch.Tensor] = []
    for w in tqdm(
        weights, desc="reading checkpoints", unit="checkpoint", file=sys.stderr, disable=not progress
    ):
        parts = [
            (w[n].reshape(-1) if idx is None else w[n].reshape(-1)[idx]).double() for n, idx in picks.items()
        ]
        rows.append(torch.cat(parts))
    x = torch.stack(rows)
    x = x - x.mean(dim=0, keepdim=True)
    # PCA through the C x C Gram matrix: X = U S V^T, X X^T = U S^2 U^T, coordinates U S.
    evals, evecs = torch.linalg.eigh(x @ x.T)
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order].clamp(min=0), evecs[:, order]
    coords = evecs[:, :2] * evals[:2].sqrt()
    explained = (evals / evals.sum()).tolist() if evals.sum() > 0 else [0.0] * len(evals)
    labels = [_label(Path(f)) for f in folders]
    plots.trajectory_plot(coords.tolist(), labels, explained[:2], out_png)
    result = {
        "checkpoints": list(map(str, folders)),
        "labels": labels,
        "coords": coords.tolist(),
        "explained_variance": explained[:2],
        "coordinates_used": int(x.shape[1]),
    }
    atomic_write_json(Path(out_png).with_suffix(".json"), result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_rl.evaluation.analysis", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("reward-length", help="reward without length penalty against mean length, log fit")
    r.add_argument("--metrics", required=True, help="metrics JSONL, one object per step")
    r.add_argument("--out", required=True, help="PNG to write (a .json of the fit goes next to it)")
    r.add_argument("--reward-key", default="reward/mean")
    r.add_argument("--penalty-key", default="reward/length_penalty")
    r.add_argument("--length-key", default="length/mean")
    w = sub.add_parser("weight-pca", help="checkpoints' weights projected on two principal components")
    w.add_argument("--checkpoints", nargs="+", required=True, help="HF checkpoint folders, in order")
    w.add_argument("--out", required=True, help="PNG to write (a .json of the coordinates next to it)")
    w.add_argument(
        "--max-coords", type=int_arg(1), default=2_000_000, help="coordinates sampled per checkpoint"
    )
    w.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.what == "reward-length":
            res = reward_length(
                args.metrics,
                args.out,
                reward_key=args.reward_key,
                penalty_key=args.penalty_key,
                length_key=args.length_key,
            )
            print(
                f"reward = {res['a']:.4f} + {res['b']:.4f} ln(length), R² {res['r2']:.3f} "
                f"over {res['points']} steps -> {args.out}"
            )
        else:
            res = weight_pca(args.checkpoints, args.out, max_coords=args.max_coords, seed=args.seed)
            ev = ", ".join(f"{100 * v:.1f}%" for v in res["explained_variance"])
            print(
                f"PCA of {len(args.checkpoints)} checkpoints over {res['coordinates_used']} "
                f"coordinates: explained variance {ev} -> {args.out}"
            )
        return 0
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"analysis {args.what}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl analysis", main))
