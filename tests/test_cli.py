"""The ``megatron-rl`` command as a user runs it (real subprocesses)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_console_script_installed():
    assert shutil.which("megatron-rl"), "pip install -e . should install the megatron-rl command"


def test_help_lists_every_verb():
    out = run("--help").stdout
    for verb in ("train", "reward", "convert", "serve-engine", "curate", "eval", "bench", "config"):
        assert verb in out


def test_building_the_parser_imports_no_torch():
    """`megatron-rl --help` answers at once: the verbs import torch, the parser does not."""
    code = (
        "import sys; from megatron_rl.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_train_names_a_bad_recipe_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("loop:\n  group_size: 4\n  n_batch: 6\n")
    proc = run("train", str(bad), check=False)
    assert proc.returncode == 2
    assert f"{bad}:3: loop.n_batch: must be a multiple of group_size (4)" in proc.stderr


def test_train_checks_the_whole_recipe_before_it_starts_anything(tmp_path):
    """A typo in the last curriculum stage, or a data path that does not exist, stops `train` at
    once with the file and line: no run directory, no server, no trainer."""
    run_dir = tmp_path / "run"
    stage = tmp_path / "stage.yaml"
    stage.write_text(
        f"run:\n  dir: {run_dir}\nloop:\n  max_steps: 100\ncurriculum:\n  - at_step: 10\n"
        "    l_max: 16384\n  - at_step: 50\n    l_cache: 20000\n"
    )
    proc = run("train", str(stage), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{stage}:9: curriculum.1.l_cache: must be in [0, l_max=16384]" in proc.stderr, proc.stderr
    paths = tmp_path / "paths.yaml"
    paths.write_text(
        f"model:\n  hf: {tmp_path}\ndata:\n  train: {tmp_path}/nope.jsonl\nrun:\n  dir: {run_dir}\n"
    )
    proc = run("train", str(paths), check=False)
    assert proc.returncode == 2 and f"{paths}:4: data.train: no such file or folder" in proc.stderr
    assert run("config", str(paths)).returncode == 0  # resolving it elsewhere is fine ...
    assert run("config", "--check-paths", str(paths), check=False).returncode == 2  # ... unless asked
    assert not run_dir.exists()


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"id": "b", "problem": "2 + 2?", "task": "math"}, "answer"),
        ({"id": "b", "problem": "2 + 2?", "answer": "  "}, "answer"),
        ({"id": "b", "problem": "Echo.", "task": "code", "tests": []}, "tests"),
    ],
)
def test_train_refuses_a_problem_it_could_never_score_naming_file_and_line(tmp_path, record, field):
    """A math problem without an answer (or a code problem without tests) would be drawn, its
    group never scored; `train` refuses it at load, before any server or trainer starts."""
    data = tmp_path / "train.jsonl"
    good = {"id": "a", "problem": "1 + 1?", "answer": "2"}
    data.write_text("\n".join(json.dumps(r) for r in (good, good | {"id": "c"}, record)) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  hf: {tmp_path}\ndata:\n  train: {data}\nrun:\n  dir: {tmp_path / 'run'}\n")
    proc = run("train", str(recipe), check=False)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr  # 3: a bad input file
    assert f"{data}:3: {field}:" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_train_needs_a_model(tmp_path):
    proc = run("train", "examples/ablation_original_grpo.yaml", check=False)
    assert proc.returncode == 2 and "model.hf: required" in proc.stderr


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_example_recipes_are_valid(recipe):
    run("config", f"examples/{recipe}")


def test_config_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batching:\n  token_budget: -5\n")
    proc = run("config", str(bad), check=False)
    assert proc.returncode == 2 and "bad.yaml:2: batching.token_budget" in proc.stderr


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def test_bench_collation_greedy_beats_uniform():
    out = run("bench", "collation", "--sequences", "512", "--batches", "2").stdout
    fig = last_json(out)
    assert "microbatches" in out and "lower bound" in out  # the readable table
    assert 1.0 <= fig["microbatches_over_lower_bound"] < fig["uniform_microbatches_over_lower_bound"]
    assert 0.0 < fig["padding_reduction_vs_uniform"] <= 1.0


def test_bench_logprobs_uses_less_memory_than_naive():
    out = run("bench", "logprobs", "--tokens", "2048", "--vocab", "32768").stdout
    fig = last_json(out)
    assert 0.0 < fig["peak_memory_ratio"] < 0.8


def test_unknown_benchmark():
    proc = run("bench", "nope", check=False)
    assert proc.returncode == 2 and "collation" in proc.stderr


def test_bench_pause_latency_runs_both_locks_and_every_pause_lands():
    out = run("bench", "pause-latency", "--trials", "1", "--max-new-tokens", "400").stdout
    fig = last_json(out)
    assert "plain lock (baseline)" in out and "ours" in out
    # the server as shipped pauses while the request runs (370 steps were left)
    assert fig["trials"] == 1 and 0 <= fig["pause_steps_fair_median"] < 370
    assert fig["pause_steps_plain_median"] >= 0


def test_bench_verifiers_prints_its_figures():
    out = run("bench", "verifiers", "--repeat", "1", "--compiles", "1").stdout
    fig = last_json(out)
    assert "per second" in out
    assert fig["verifications"] == 68 and fig["math_pool_speedup"] > 0 and fig["cpp_pch_compile_ratio"] > 0
