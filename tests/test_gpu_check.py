"""tools/gpu_check.sh on CPU: the plan fits 10 minutes and needs no GPU, a machine without CUDA
gets one line and exit status 2, a step past its budget is killed with what it started, and the
SGLang flags the GPU steps pass are SGLang 0.5.23's own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402  (tools/ is not a package)
import gpu_check_sglang  # noqa: E402

SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_plan_prints_every_step_and_a_sum_within_ten_minutes(tmp_path):
    # A torch that cannot be imported: --plan must not need it (nor touch a GPU).
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch for --plan')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--plan"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    names = [line.split()[0] for line in lines[1:-1]]
    assert names == [s.name for s in gpu_check.STEPS]
    budgets = [int(line.split()[1]) for line in lines[1:-1]]
    total = int(lines[-1].split()[1])
    assert total == sum(budgets) == sum(s.budget_s for s in gpu_check.STEPS)
    assert total <= 600 and gpu_check.TOTAL_BUDGET_S == 600
    assert names[0] == "setup" and all(b > 0 for b in budgets)


def test_without_cuda_one_line_and_exit_2():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    # The 60 s bound is a hang guard, not a timing assertion: the probe is one torch import.
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu_check: no CUDA device here"), out


def test_every_step_needs_a_known_dependency_and_every_figure_a_step():
    names = {s.name for s in gpu_check.STEPS}
    for s in gpu_check.STEPS:
        assert set(s.needs) <= {"sglang", "memory_saver", "2 GPUs"}, s
    assert {step for _, step, _, _ in gpu_check.FIGURES} <= names
    machine = {"cuda": True, "gpus": 1, "sglang": False, "memory_saver": False}
    why = {s.name: gpu_check._missing(s, machine) for s in gpu_check.STEPS}
    assert why["train_step"] is None
    assert "sglang is not installed" in why["sglang_generation"]
    assert "needs 2 GPUs" in gpu_check._missing(gpu_check.STEPS[-1], {**machine, "sglang": True})


class _Sleeper(gpu_check.Step):
    """A step that starts a grandchild and never ends."""

    def command(self, work, logs):
        code = (
            "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print(p.pid, flush=True); time.sleep(600)"
        )
        return [sys.executable, "-c", code]


@pytest.mark.slow
def test_a_step_past_its_budget_is_killed_with_its_children(tmp_path):
    step = _Sleeper("sleeper", 7, (), "sleeps")
    result = gpu_check.run_step(step, tmp_path, tmp_path, timeout_s=7)
    assert "over its budget of 7 s" in result["failed"]
    grandchild = int((tmp_path / "sleeper.log").read_text().split()[0])
    with pytest.raises(ProcessLookupError):  # reaped by init once killed
        for _ in range(50):
            os.kill(grandchild, 0)
            __import__("time").sleep(0.1)


def test_docs_gpu_table_has_a_row_per_figure():
    page = (ROOT / "docs" / "gpu-cluster.md").read_text()
    table = page.split("<!-- gpu:begin -->", 1)[1].split("<!-- gpu:end -->", 1)[0]
    rows = [r.split("|")[1].strip().strip("`") for r in table.strip().splitlines()[2:]]
    assert rows == [name for name, _, _, _ in gpu_check.FIGURES]


def test_table_rows_and_figures_from_step_results():
    steps = {
        "train_step": {"mfu": 0.41234, "tokens_per_s": 1.0e5, "transformer_engine": True},
        "sglang_generation": {"skipped": "sglang is not installed"},
        "colocated_update": {"failed": "boom"},
    }
    fig = gpu_check.figures(steps)
    assert fig["trainer_mfu"] == 0.41234 and fig["sglang_tokens_per_s"] is None
    rows = gpu_check.table_rows(steps, {"device": "NVIDIA H200"}).splitlines()
    assert rows[0] == (
        "| `trainer_mfu` | 0.4123 | MFU of one GRPO step (6 N tokens/s over 989 TFLOP/s bf16) "
        "| `train_step` | NVIDIA H200 |"
    )
    assert "skipped: sglang is not installed" in rows[3] and "| failed |" in rows[4]
    json.dumps(fig)  # the last line is JSON


def test_sglang_launch_flags_are_sglang_0_5_23_flags():
    from megatron_rl.generation.protocol import SGLANG_VERSION

    fixture = ROOT / "tests" / "generation" / "fixtures" / f"sglang-{SGLANG_VERSION}.json"
    known = set(json.loads(fixture.read_text())["server_flags"])
    for step, extra in gpu_check_sglang.SERVER_EXTRA.items():
        cmd = gpu_check_sglang.server_command(Path("m"), 1, extra)
        flags = [a for a in cmd[3:] if a.startswith("--")]
        assert set(flags) <= known, (step, set(flags) - known)
    routes = json.loads(fixture.read_text())["routes"]
    assert "/get_weights_by_name" in routes  # the weights check reads lm_head through it


def test_rl_workload_is_groups_with_long_tailed_lengths():
    prompts, lengths = gpu_check_sglang.rl_workload()
    assert len(prompts) == len(lengths) == 64 and all(len(g) == 8 for g in lengths)
    flat = sorted(n for g in lengths for n in g)
    assert flat[len(flat) // 2] < 1024 and flat[-1] > 2048 and max(flat) <= 4096
    assert gpu_check_sglang.rl_workload() == (prompts, lengths)  # seeded
