"""`megatron-rl ablate async` end to end at toy size: arms share one warm-up, every arm-and-seed
is a real `megatron-rl train` run, results.json / results.md / ablation.png hold what the issue
asks, a second invocation resumes (finished arms are not run again), and mistakes are one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from megatron_rl.cli.ablate import plan_arms
from megatron_rl.evaluation.ablation import RECORD_FIELDS
from megatron_rl.orchestration.recipe import load_config
from tests.orchestration.conftest import ROOT, recipe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _warmup(tmp_path, policy):
    warm = tmp_path / "abl" / "warmup"
    warm.mkdir(parents=True)
    train = [json.loads(x) for x in open(policy["train"])]
    (warm / "held_out.jsonl").write_text("".join(json.dumps(p) + "\n" for p in train[:12]))
    paths = {"train": policy["train"], "held_out": str(warm / "held_out.jsonl"), "sft": policy["model"]}
    (warm / "warmup.json").write_text(json.dumps({"paths": paths, "seconds": {"total": 1.0}}))
    return tmp_path / "abl"


def _ablate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", "ablate", "async", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_ablate_async_runs_arms_writes_results_and_resumes(tmp_path, policy):
    out = _warmup(tmp_path, policy)
    path = recipe(
        tmp_path,
        policy,
        fleet={"local_servers": 1, "max_slots": 16},
        run={"eval_samples": 12, "eval_k": 1, "checkpoint_every": 2},
        weight_sync={"verify": False},
    )
    args = ["--out", str(out), "--recipe", str(path), "--ratios", "2", "--seeds", "1", "--steps", "2"]
    args += ["--evals", "2", "--arms", "sync,async-r2"]
    first = _ablate(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    records = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in records] == ["sync", "async-r2"]
    for r in records:
        assert set(RECORD_FIELDS) <= set(r)
        assert r["steps"] == 2 and r["samples"] == 32 and r["seed"] == 0
        assert 0.0 <= r["pass1_before"] <= 1.0 and 0.0 <= r["pass1_after"] <= 1.0
        assert [p["step"] for p in r["curve"]] == [0.0, 1.0, 2.0]  # evaluations at steps 0, 1, 2
        assert r["wall_s"] > 0 and r["wall_equal_s"] == min(x["wall_s"] for x in records)
        assert r["staleness_tokens"] == sum(r["staleness_hist"].values()) > 0
    sync, fast = records
    assert sync["mode"] == "sync" and sync["ratio"] is None and sync["objective"] == "magistral"
    assert sync["staleness_mean"] == 0.0 and set(sync["staleness_hist"]) == {"0"}
    assert fast["mode"] == "async" and fast["ratio"] == 2.0 and fast["minibatch_ratio"] == 1.0
    # the async arm's recipe really was async at ratio 2 on the same, larger fleet
    resolved = yaml.safe_load((out / "runs" / "async-r2" / "seed0" / "config.yaml").read_text())
    assert resolved["loop"]["mode"] == "async" and resolved["loop"]["n_async"] == 32
    assert resolved["fleet"]["max_slots"] == 32 and resolved["run"]["eval_every"] == 1
    assert "| sync | sync |" in (out / "results.md").read_text()
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["arms"]["sync"]["seeds"] == 1

    again = _ablate(*args)  # finished arms are read back, not trained again
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training (" not in again.stderr and again.stderr.count("pass@1") >= 2
    assert json.loads((out / "results.json").read_text())[0]["pass1_after"] == sync["pass1_after"]

    fewer = _ablate(*[a if a != "2" or i != args.index("--steps") + 1 else "1" for i, a in enumerate(args)])
    assert fewer.returncode == 4 and "ran 2 optimizer steps, more than the 1 it takes now" in fewer.stderr
    assert "Traceback" not in fewer.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ratios", "1,x"], "--ratios '1,x': expected numbers"),
        (["--ratios", "0"], "expected positive numbers"),
        (["--ratios", "0.3"], "not a whole number of groups"),
        (["--arms", "sync,async-r9"], "no arm 'async-r9'"),
        (["--seeds", "0"], "--seeds: must be an integer >= 1, got 0"),
        (["loop.n_batch=abc"], "loop.n_batch"),
    ],
)
def test_ablate_mistakes_are_one_line(tmp_path, args, message):
    proc = _ablate("--out", str(tmp_path / "o"), *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "warmup").exists()  # refused before minutes of warm-up


def test_ablate_out_must_be_a_folder(tmp_path):
    (tmp_path / "f").write_text("keep me")
    proc = _ablate("--out", str(tmp_path / "f"))
    assert proc.returncode == 4 and "is a file" in proc.stderr
    assert (tmp_path / "f").read_text() == "keep me"


def test_default_grid_arms():
    cfg = load_config(str(ROOT / "examples" / "quickstart.yaml"))
    arms = plan_arms([1, 2, 4], cfg)
    assert [a.name for a in arms] == [
        "sync",
        "async-r1",
        "async-r2",
        "async-r4",
        "async-r2-mb4",
        "decoupled-r4",
    ]
    fig6b = arms[4].overrides(cfg)
    assert "loop.n_minibatch=32" in fig6b and "loop.n_async=256" in fig6b  # n_batch 128 / 4, ratio 2
    assert "algorithm.objective=decoupled" in arms[5].overrides(cfg)
    assert "loop.mode=sync" in arms[0].overrides(cfg)
