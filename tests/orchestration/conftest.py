"""A tiny policy that already writes the answer format (a short SFT of the quick start's
pieces, ~30 s once per session), so the RL loop sees groups with different rewards."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PROMPT = "Think inside <think> </think>, then answer."


@pytest.fixture(scope="session")
def policy(tmp_path_factory) -> dict[str, str]:
    """``{"model": HF folder, "train": problems JSONL}`` of a format-aware tiny policy."""
    from megatron_rl.data.problems import write_problems
    from megatron_rl.quickstart.model import TinyModelConfig, build_model_folder
    from megatron_rl.quickstart.sft import format_trace
    from megatron_rl.quickstart.tokenizer import build_tokenizer
    from megatron_rl.rewards.template import MATH_INSTRUCTION

    out = tmp_path_factory.mktemp("policy")
    train = _train_problems()
    write_problems(out / "train.jsonl", (p.to_record() for p in train))
    corpus = [SYSTEM_PROMPT, MATH_INSTRUCTION]
    corpus += [t for p in train for t in (p.problem, format_trace(p))]
    tok = build_tokenizer(corpus, out / "tok")
    init = build_model_folder(
        TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, max_positions=160),
        tok,
        out / "init",
    )
    # A subprocess: the SFT trainer sets up (and tears down) Megatron state of its own.
    code = f"from tests.orchestration.conftest import _sft; _sft({str(init)!r}, {str(out / 'sft')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    return {"model": str(out / "sft"), "train": str(out / "train.jsonl")}


def _train_problems():
    from megatron_rl.quickstart.problems import ProblemConfig, generate_problems, split_problems

    problems = generate_problems(ProblemConfig(count=600, difficulty_weights=(1, 1, 0)))
    return split_problems(problems, 0.1)[0]


def _sft(init: str, out: str) -> None:
    from megatron_rl.quickstart.sft import SFTConfig, run_sft

    run_sft(
        init,
        _train_problems(),
        out,
        SFTConfig(steps=60, batch_size=32, warmup_steps=5, lr=3e-3),
        progress=False,
    )


def recipe(tmp_path: Path, policy: dict, name: str = "run", **sections) -> Path:
    """A small recipe for ``policy`` (1 verifier worker, short completions); ``sections``
    override whole keys, e.g. ``loop={"mode": "sync"}``."""
    cfg = {
        "model": {"hf": policy["model"]},
        "data": {"train": policy["train"], "system_prompt": SYSTEM_PROMPT},
        "loop": {"group_size": 4, "n_batch": 16, "n_async": 32, "max_steps": 3},
        "reward": {"l_max": 48, "l_cache": 16, "workers": 1},
        "fleet": {"local_servers": 2, "max_slots": 16, "max_len": 160},
        "trainer": {"optim": {"lr": 1.0e-4}},
        "weight_sync": {"verify": True},
        "run": {"dir": str(tmp_path / name), "checkpoint_every": 1},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_cmd(path: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl", "train", str(path), "--no-progress", *overrides]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return out


def wait_for(predicate, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
