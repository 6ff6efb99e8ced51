"""`megatron-rl quickstart` end to end at toy size: it reuses a warm-up folder, runs GRPO with the
quick start recipe, and reports held-out pass@1 before and after RL with the plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.orchestration.conftest import ROOT, SYSTEM_PROMPT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_quickstart_reports_before_after_and_plots(tmp_path, policy):
    warm = tmp_path / "qs" / "warmup"
    warm.mkdir(parents=True)
    train = [json.loads(x) for x in open(policy["train"])]
    (warm / "held_out.jsonl").write_text("".join(json.dumps(p) + "\n" for p in train[:12]))
    (warm / "warmup.json").write_text(
        json.dumps(
            {
                "paths": {
                    "train": policy["train"],
                    "held_out": str(warm / "held_out.jsonl"),
                    "sft": policy["model"],
                },
                "seconds": {"total": 1.0},
            }
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "quickstart",
            "--out",
            str(tmp_path / "qs"),
            "loop.max_steps=2",
            "loop.n_batch=16",
            "loop.n_async=32",
            "loop.group_size=4",
            "reward.l_max=48",
            "reward.l_cache=16",
            "fleet.max_slots=16",
            f"data.system_prompt={SYSTEM_PROMPT}",
            "run.eval_samples=12",
            "run.eval_k=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    assert 0.0 <= report["pass@1_sft"] <= 1.0 and 0.0 <= report["pass@1_rl"] <= 1.0
    assert report["rl_steps"] == 2
    assert "held-out pass@1: SFT" in proc.stderr
    assert all(
        (tmp_path / "qs" / "rl" / "plots").joinpath(p.split("/")[-1]).exists() for p in report["plots"]
    )
    evals = [json.loads(x) for x in open(tmp_path / "qs" / "rl" / "eval.jsonl")]
    assert [e["label"] for e in evals] == ["before", "after"]
    assert all(e["problems"] == 12 for e in evals)
