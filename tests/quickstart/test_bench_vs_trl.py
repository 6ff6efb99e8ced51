"""`megatron-rl bench vs-trl`'s arithmetic: the parameter count its FLOP utilisation rests on is the
one transformers builds, the computed FLOPs drop only the output layer at prompt positions, the
reward at equal wall time is the last step that ended by then (the warm-up's before any); and a wrong --policy is one line.
The bench itself runs in tests/quickstart/test_pretrained.py (slow, on the cold-started SmolLM2)."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = runpy.run_path(str(ROOT / "tools" / "bench_vs_trl.py"), run_name="bench")

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
}


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_is_the_one_transformers_builds(tmp_path, tied):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(SMOLLM2, tie_word_embeddings=tied)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    shape = BENCH["model_shape"](tmp_path)
    assert shape["params"] == sum(p.numel() for p in model.parameters())
    assert (shape["layers"], shape["hidden"], shape["vocab"]) == (30, 576, 49152)
    if tied:
        assert 134_000_000 < shape["params"] < 135_000_000  # SmolLM2-135M


def test_computed_flops_leave_out_the_output_layer_at_prompt_positions_only():
    shape = {"params": 1000, "layers": 2, "hidden": 4, "vocab": 10}
    formula, computed = BENCH["train_flops"](shape, 100.0, 100.0, 50.0)
    assert formula == computed == 6 * 1000 * 100 + 6 * 2 * 4 * 50
    formula, computed = BENCH["train_flops"](shape, 100.0, 40.0, 50.0)
    assert formula - computed == 6 * 10 * 4 * 60


def test_the_reward_at_equal_time_is_the_last_step_ended_by_then():
    curve = [(10.0, 0.1), (20.0, 0.4), (30.0, 0.2)]
    assert BENCH["reward_at"](curve, 25.0, 0.0) == 0.4
    assert BENCH["reward_at"](curve, 30.0, 0.0) == 0.2
    assert BENCH["reward_at"](curve, 5.0, 0.05) == 0.05  # no step ended yet: the warm-up's reward


@pytest.mark.fault("input")
def test_a_policy_folder_without_a_config_is_one_line_and_a_failure(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "bench",
            "vs-trl",
            "--policy",
            str(tmp_path),
            "--dir",
            str(tmp_path / "d"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    # Without TRL installed the bench says so first; with it, the folder is named.
    assert str(tmp_path) in proc.stderr or "TRL is not installed" in proc.stderr, proc.stderr
    assert not (tmp_path / "d" / "ours-sync").exists()
