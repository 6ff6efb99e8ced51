"""The quick starts' stages: each a process of its own, timed, and the RL stage's command.

    seconds = run_stage("GRPO (async loop, full reward)", train_command(recipe, paths, rl, []))

A stage runs in a child process (each sets up its own Megatron state, and a crash or Ctrl-C of
one stage leaves the folders of those before it complete); a stage that fails stops the quick
start with one line naming it and its exit status.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_stage", "train_command"]


def run_stage(title: str, cmd: list[str]) -> float:
    """Run ``cmd`` as the stage ``title`` (printed with the command); its wall seconds.
    SystemExit naming the stage when it fails."""
    print(f"\n== {title}\n$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd)
    if proc.returncode:
        raise SystemExit(f"quickstart: {title} failed (exit {proc.returncode})")
    return time.monotonic() - t0


def train_command(recipe: str, paths: dict[str, str], run_dir: Path, overrides: list[str]) -> list[str]:
    """``megatron-rl train`` of ``recipe`` on a warm-up's policy and problems (``paths``: its
    ``sft``, ``train``, ``held_out``) into ``run_dir``, with ``overrides`` after."""
    return [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        recipe,
        f"model.hf={paths['sft']}",
        f"data.train={paths['train']}",
        f"data.eval={paths['held_out']}",
        f"run.dir={run_dir}",
        *overrides,
    ]
