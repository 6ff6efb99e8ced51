"""Run analysis: the log fit of reward against length, and PCA of a weight trajectory."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.data.problems import DataError
from megatron_rl.evaluation.analysis import fit_log, main, reward_length, weight_pca

PNG = b"\x89PNG\r\n\x1a\n"


def test_fit_log_recovers_the_curve():
    xs = [100, 300, 1000, 3000, 10000]
    fit = fit_log(xs, [0.1 + 0.05 * math.log(x) for x in xs])
    assert (
        fit["a"] == pytest.approx(0.1) and fit["b"] == pytest.approx(0.05) and fit["r2"] == pytest.approx(1.0)
    )
    with pytest.raises(ValueError, match="every length is the same"):
        fit_log([5, 5], [1, 2])


def test_reward_length_removes_the_length_penalty(tmp_path, capsys):
    rows = []
    for step in range(1, 30):
        length = 200 * step
        penalty = -0.1 if step > 20 else 0.0  # late steps hit the length penalty
        rows.append(
            {
                "step": step,
                "reward/mean": 0.2 + 0.1 * math.log(length) + penalty,
                "reward/length_penalty": penalty,
                "length/mean": length,
            }
        )
        rows.append({"step": step, "eval/aime": 0.3})  # other lines are skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = reward_length(tmp_path / "metrics.jsonl", tmp_path / "fig9.png")
    assert res["b"] == pytest.approx(0.1) and res["r2"] == pytest.approx(1.0) and res["points"] == 29
    assert (tmp_path / "fig9.png").read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "fig9.json").read_text())["a"] == pytest.approx(0.2)
    assert (
        main(
            [
                "reward-length",
                "--metrics",
                str(tmp_path / "metrics.jsonl"),
                "--out",
                str(tmp_path / "again.png"),
            ]
        )
        == 0
    )
    assert "0.1000 ln(length)" in capsys.readouterr().out
    rows[4]["length/mean"] = "long"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"metrics.jsonl:5: length/mean: expected a number"):
        reward_length(tmp_path / "metrics.jsonl", tmp_path / "x.png")


def checkpoints(tmp_path, n=6) -> list[str]:
    """Weights moving along one direction with a small wiggle along another."""
    g = torch.Generator().manual_seed(0)
    base = {"a.weight": torch.randn(40, 30, generator=g), "b.bias": torch.randn(50, generator=g)}
    d1 = {k: torch.randn(v.shape, generator=g) for k, v in base.items()}
    d2 = {k: torch.randn(v.shape, generator=g) for k, v in base.items()}
    folders = []
    for i in range(n):
        folder = tmp_path / f"step_{i * 100}"
        folder.mkdir()
        save_file(
            {k: base[k] + i * d1[k] + 0.1 * (-1) ** i * d2[k] for k in base},
            str(folder / "model.safetensors"),
        )
        folders.append(str(folder))
    return folders


def test_weight_pca_finds_the_main_direction(tmp_path):
    folders = checkpoints(tmp_path)
    res = weight_pca(folders, tmp_path / "fig8.png")
    assert res["explained_variance"][0] > 0.99 and res["coordinates_used"] == 40 * 30 + 50
    pc1 = [c[0] for c in res["coords"]]
    steps = [b - a for a, b in zip(pc1, pc1[1:])]
    assert all(s > 0 for s in steps) or all(s < 0 for s in steps)  # monotone along the trajectory
    assert res["labels"] == ["0", "100", "200", "300", "400", "500"]
    assert (tmp_path / "fig8.png").read_bytes()[:8] == PNG
    sampled = weight_pca(folders, tmp_path / "sub.png", max_coords=300)
    assert 250 <= sampled["coordinates_used"] <= 350 and sampled["explained_variance"][0] > 0.98


def test_weight_pca_refuses_mismatched_checkpoints(tmp_path):
    folders = checkpoints(tmp_path, 3)
    save_file(
        {"a.weight": torch.zeros(40, 30), "c": torch.zeros(2)},
        str(tmp_path / "step_200" / "model.safetensors"),
    )
    with pytest.raises(DataError, match="holds different tensors"):
        weight_pca(folders, tmp_path / "x.png")
    assert main(["weight-pca", "--checkpoints", folders[0], "--out", str(tmp_path / "y.png")]) == 2
