"""The GPU figures the CPU machines cannot give, in one run of at most 10 minutes on ONE NVIDIA
GPU (H100/H200 class), after ``pip install -e '.[gpu,test]'``.

    bash tools/gpu_check.sh            # or: python tools/gpu_check.py [--out gpu_check.json]
    bash tools/gpu_check.sh --plan     # the steps, their time budgets and the sum; no GPU touched

Every step measures our own code path on one ~1.1B-parameter Llama (hidden 2048, 16 layers, GQA
16/8, MLP 5632, vocab 32k, bf16, random weights):

- ``train_step``: MFU of ``PolicyTrainer.rl_step`` (``megatron-rl bench train-step``, Transformer
  Engine's layer spec when it is installed, else the plain PyTorch spec; the JSON says which),
  8 sequences of 512 prompt + 2,048-4,096 completion tokens per step;
- ``sglang_generation``: SGLang tokens/s on the RL workload (groups of 8 samples sharing a prompt,
  lognormal completion lengths, a new group sent as one completes), driven by our ``FleetClient``;
- ``colocated_update``: the colocated weight update (``weight_sync/colocated.py``,
  ``TensorPusher``): SGLang and the trainer on the same GPU, release -> a training step -> weights
  by CUDA IPC handle through ``/update_weights_from_tensor`` -> resume, checked by reading a
  tensor back from SGLang;
- ``nccl_weight_sync``: our NCCL weight broadcast (``weight_sync/broadcast.py``,
  ``WeightBroadcaster``) from the trainer on GPU 0 into SGLang on GPU 1; needs 2 GPUs.

Each step runs in a process group of its own under its budget (``STEPS``; the sum, setup
included, is at most 600 s) and is killed, with every process it started, when the budget runs
out. A step whose dependency is missing (SGLang, torch_memory_saver, a second GPU) is skipped
with the reason in the JSON. The whole result goes to ``--out`` (default ``$OUT/gpu_check.json``,
or ``./gpu_check.json`` without ``$OUT``), each step's output and SGLang's logs to
``gpu_check_logs/`` beside it; the last lines printed are the GPU table rows of docs/gpu-cluster.md
this run fills, then one JSON object of the figures. Without CUDA it prints one line and exits 2.
The step programs are ``tools/gpu_check_sglang.py`` (SGLang steps) and ``megatron-rl bench
train-step``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent

#: The model every step uses (HF Llama config fields): ~1.1B parameters.
MODEL = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "intermediate_size": 5632,
    "vocab_size": 32000,
}
TRAIN_ARGS = [
    *("--hidden", "2048", "--layers", "16", "--heads", "16", "--kv-heads", "8"),
    *("--ffn", "5632", "--vocab", "32000", "--sequences", "8", "--group-size", "8"),
    *("--prompt", "512", "--completion", "4096", "--budget", "8192", "--warmup", "1", "--steps", "3"),
    "--no-baseline",  # the plain HF baseline runs fp32: no fair ratio against our bf16 step
]

# Seconds between SIGTERM and SIGKILL of a step's process group; taken out of its budget.
KILL_GRACE_S = 5


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int  # hard limit: the step's process group is killed at it
    needs: tuple[str, ...]  # of "sglang", "memory_saver", "2 GPUs"; the step is skipped without one
    what: str

    def command(self, work: Path, logs: Path) -> list[str]:
        py = sys.executable
        if self.name == "train_step":
            return [py, "-m", "megatron_rl", "bench", "train-step", *TRAIN_ARGS]
        sub = {"sglang_generation": "generation", "colocated_update": "colocated", "nccl_weight_sync": "nccl"}
        return [
            py,
            str(TOOLS / "gpu_check_sglang.py"),
            sub[self.name],
            "--work",
            str(work),
            "--logs",
            str(logs),
        ]


# The plan, in the order run. Budgets: each step's measured part is sized to take about half of
# its budget on an H200; the rest is start-up (imports, a 1.1B model built and saved, SGLang's
# server start with CUDA-graph capture), which dominates the SGLang steps.
STEPS: tuple[Step, ...] = (
    Step("setup", 15, (), "CUDA device, GPU count, which of TE / SGLang / torch_memory_saver are installed"),
    Step("train_step", 150, (), "trainer MFU and tokens/s: PolicyTrainer.rl_step, bf16, TE when installed"),
    Step("sglang_generation", 170, ("sglang",), "SGLang tokens/s on the RL workload, via FleetClient"),
    Step(
        "colocated_update",
        150,
        ("sglang", "memory_saver"),
        "colocated weight update on one GPU: release, train, update_weights_from_tensor, resume",
    ),
    Step("nccl_weight_sync", 100, ("sglang", "2 GPUs"), "NCCL weight sync trainer GPU 0 -> SGLang GPU 1"),
)
TOTAL_BUDGET_S = 600

#: The GPU table rows of docs/gpu-cluster.md: (figure, step, key in the step's JSON, what it is).
FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("trainer_mfu", "train_step", "mfu", "MFU of one GRPO step (6 N tokens/s over 989 TFLOP/s bf16)"),
    ("trainer_tokens_per_s", "train_step", "tokens_per_s", "GRPO step tokens/s (prompt + completion)"),
    ("trainer_transformer_engine", "train_step", "transformer_engine", "Transformer Engine layer spec used"),
    (
        "sglang_tokens_per_s",
        "sglang_generation",
        "sglang_tokens_per_s",
        "SGLang generated tokens/s, RL workload",
    ),
    (
        "colocated_update_s",
        "colocated_update",
        "update_s",
        "colocated weight update (resume + push + KV back), s",
    ),
    (
        "colocated_update_gbps",
        "colocated_update",
        "update_gbps",
        "colocated weight update GB/s (bf16 bytes / s)",
    ),
    ("colocated_release_s", "colocated_update", "release_s", "release of SGLang's memory before training, s"),
    ("nccl_sync_s", "nccl_weight_sync", "sync_s", "NCCL weight sync into SGLang (pause ... continue), s"),
    ("nccl_sync_gbps", "nccl_weight_sync", "sync_gbps", "NCCL weight sync GB/s (bf16 bytes / s)"),
)


def plan_text() -> str:
    """The steps, their budgets and the sum, as ``--plan`` prints them."""
    lines = [f"{'step':18} {'budget s':>8}  {'needs':20} what"]
    for s in STEPS:
        lines.append(f"{s.name:18} {s.budget_s:8d}  {', '.join(s.needs) or '-':20} {s.what}")
    total = sum(s.budget_s for s in STEPS)
    lines.append(f"{'total':18} {total:8d}  (limit {TOTAL_BUDGET_S} s, setup included)")
    return "\n".join(lines)


_PROBE = """
import importlib.util, json, torch
cuda = torch.cuda.is_available()
found = lambda m: importlib.util.find_spec(m) is not None
print(json.dumps({
    "cuda": cuda,
    "gpus": torch.cuda.device_count() if cuda else 0,
    "device": torch.cuda.get_device_name(0) if cuda else None,
    "torch": torch.__version__,
    "cuda_version": torch.version.cuda,
    "transformer_engine": found("transformer_engine"),
    "sglang": found("sglang"),
    "memory_saver": found("torch_memory_saver"),
}))
"""


def probe(timeout_s: float) -> dict[str, object]:
    """What this machine has (the ``setup`` step), from a child process: a torch that hangs on
    a broken driver is killed at ``timeout_s``; a missing torch reads as no CUDA."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"cuda": False, "why": f"probing torch.cuda took over {timeout_s:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"cuda": False, "why": f"torch could not be probed: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _missing(step: Step, machine: dict[str, object]) -> str | None:
    """Why ``step`` cannot run here, or None."""
    why = {
        "sglang": ("sglang", "sglang is not installed (pip install -e '.[gpu]')"),
        "memory_saver": (
            "memory_saver",
            "torch_memory_saver is not installed (SGLang's --enable-memory-saver)",
        ),
    }
    for need in step.needs:
        if need == "2 GPUs":
            if int(machine.get("gpus") or 0) < 2:
                return f"needs 2 GPUs (trainer on one, SGLang on the other); this machine has {machine.get('gpus')}"
        elif not machine.get(why[need][0]):
            return why[need][1]
    return None


def run_step(step: Step, work: Path, logs: Path, timeout_s: float) -> dict[str, object]:
    """Run ``step`` in a process group of its own, its output streamed here, killed whole at
    ``timeout_s``; its last-line JSON with ``exit_status`` and ``wall_s``."""
    t0 = time.monotonic()
    log_path = logs / f"{step.name}.log"
    proc = subprocess.Popen(
        step.command(work, logs),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: the SGLang server it starts dies with it
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        with open(log_path, "w") as log:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                log.write(line)
                print(f"  {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout_s - KILL_GRACE_S))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    finally:
        if proc.poll() is None:  # interrupted: take the step's processes with us
            _kill_group(proc)
    reader.join(timeout=5)
    result: dict[str, object] = {}
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except ValueError:
                continue
    if timed_out:
        result = {**result, "failed": f"over its budget of {step.budget_s} s: killed at {timeout_s:.0f} s"}
    elif proc.returncode != 0 and "failed" not in result:
        result = {**result, "failed": f"exit status {proc.returncode}; see {log_path}"}
    elif not result:
        result = {"failed": f"no JSON line in its output; see {log_path}"}
    result.update(exit_status=proc.returncode, wall_s=round(time.monotonic() - t0, 1), budget_s=step.budget_s)
    return result


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the step's process group, SIGKILL after the grace period (the group we
    started: never processes found by name)."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def figures(steps: dict[str, dict[str, object]]) -> dict[str, object]:
    """``FIGURES``' values from the steps' results (None where skipped or failed)."""
    return {name: (steps.get(step) or {}).get(key) for name, step, key, _ in FIGURES}


def table_rows(steps: dict[str, dict[str, object]], machine: dict[str, object]) -> str:
    """The GPU table rows (docs/gpu-cluster.md) for this run: value, or why there is none."""
    rows = []
    for name, step, key, what in FIGURES:
        r = steps.get(step) or {}
        value = r.get(key)
        if value is None:
            shown = "skipped: " + str(r["skipped"]) if "skipped" in r else "failed" if "failed" in r else "—"
        else:
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        rows.append(f"| `{name}` | {shown} | {what} | `{step}` | {machine.get('device') or '—'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=plan_text(),
    )
    ap.add_argument("--plan", action="store_true", help="print the steps and budgets; touch no GPU")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", ".")) / "gpu_check.json",
        help="the JSON of every figure (default $OUT/gpu_check.json, else ./gpu_check.json)",
    )
    args = ap.parse_args(argv)
    if args.plan:
        print(plan_text())
        return 0
    start = time.monotonic()
    setup = STEPS[0]
    machine = probe(setup.budget_s)
    if not machine.get("cuda"):
        why = machine.get("why") or "torch.cuda.is_available() is False"
        print(f"gpu_check: no CUDA device here ({why}); nothing measured", file=sys.stderr)
        return 2
    print(
        f"gpu_check: {machine['device']} x {machine['gpus']}; torch {machine['torch']}; "
        + ", ".join(
            f"{m} {'yes' if machine[m] else 'NO'}" for m in ("transformer_engine", "sglang", "memory_saver")
        ),
        flush=True,
    )
    steps: dict[str, dict[str, object]] = {"setup": {"wall_s": round(time.monotonic() - start, 1)}}
    deadline = start + TOTAL_BUDGET_S
    logs = args.out.parent / "gpu_check_logs"  # each step's output and SGLang's server logs
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:  # the 2.2 GB model: not kept
        work = Path(tmp)
        for i, step in enumerate(STEPS[1:], 2):
            why = _missing(step, machine)
            print(f"== {i}/{len(STEPS)} {step.name} (budget {step.budget_s} s)", flush=True)
            if why is not None:
                steps[step.name] = {"skipped": why}
                print(f"  skipped: {why}", flush=True)
                continue
            left = deadline - time.monotonic()
            if left < 30:
                steps[step.name] = {"skipped": f"only {left:.0f} s left of the {TOTAL_BUDGET_S} s"}
                continue
            steps[step.name] = run_step(step, work, logs, min(step.budget_s, left))
    if "train_step" in steps and "skipped" not in steps["train_step"]:
        steps["train_step"]["transformer_engine"] = bool(machine["transformer_engine"])
    result = {
        "machine": machine,
        "plan": {s.name: s.budget_s for s in STEPS},
        "steps": steps,
        "figures": figures(steps),
        "total_wall_s": round(time.monotonic() - start, 1),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu_check: wrote {args.out} in {result['total_wall_s']} s; GPU table rows (docs/gpu-cluster.md):")
    print(table_rows(steps, machine))
    print(json.dumps(result["figures"]))
    failed = [n for n, r in steps.items() if "failed" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
