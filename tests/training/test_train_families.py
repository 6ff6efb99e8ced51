"""`megatron-rl train` end to end on a tiny Qwen3 (q/k norms), a tiny Qwen3-MoE and a tiny Mixtral
(4 experts, top 2 each), a tiny Mistral3 (a vision-language checkpoint whose language model
trains while its vision tower is carried through) and a tiny DeepSeek-V3 (multi-latent attention,
a dense layer, then sigmoid routing with shared experts), two MoE families also with routing
replay: the trainer builds the family, the weight broadcast carries its names (q/k norms, router,
experts) to the built-in engine bit for bit, and the final policy exports as an HF folder that
the engine and transformers load."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "family",
    ["qwen3", "qwen3_moe", "mixtral", "mistral3", "deepseek_v3", "qwen3_moe+replay", "deepseek_v3+replay"],
)
def test_a_short_run_trains_the_family_and_syncs_its_weights(tmp_path, family):
    """``+replay``: with MoE routing replay (the engine returns every position's experts, the
    trainer's routers take them)."""
    family, _, replay = family.partition("+")
    import transformers

    from megatron_rl.generation.engine import Decoder
    from megatron_rl.hf.files import HFWeights
    from tests.data.tinylm import answering_model, tiny_train_command

    answering_model(tmp_path / "model", family=family)  # \boxed{4} three times in four, else 5
    train = tmp_path / "train.jsonl"
    rows = [{"id": f"q{i}", "problem": f"What is {i} + {4 - i}?", "answer": "4"} for i in range(8)]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cmd = tiny_train_command(
        tmp_path / "model",
        run,
        2,
        f"data.train={train}",
        "data.eval=",
        "weight_sync.verify=true",
        *(["algorithm.routing_replay=rollout"] if replay else []),
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 2
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["weight_sync/verified"] == 1.0  # the engine holds the trainer's weights exactly
        assert m["weight_sync/version"] == m["step"]
    # The exported policy: this family's tensors, moved by training, loadable by both.
    exported = Decoder.from_pretrained(run / "hf")
    start = Decoder.from_pretrained(tmp_path / "model")
    assert json.loads((run / "hf" / "config.json").read_text())["model_type"] == family
    changed = {n for n, p in exported.named_weights().items() if not torch.equal(p, start.named_weights()[n])}
    assert any(n.endswith("lm_head.weight") for n in changed)
    if family == "mistral3":  # the language model trained; the vision tower came back bit for bit
        assert any(n.startswith("language_model.model.layers.") for n in changed)
        new, old = HFWeights(run / "hf"), HFWeights(tmp_path / "model")
        carried = [n for n in old if n.startswith(("vision_tower.", "multi_modal_projector."))]
        assert carried and all(torch.equal(new[n], old[n]) and new.dtype(n) == old.dtype(n) for n in carried)
        loaded = transformers.AutoModelForImageTextToText.from_pretrained(run / "hf")
        assert type(loaded).__name__ == "Mistral3ForConditionalGeneration"
        # The run's checkpoint keeps the vision tower: it exports whole with only a config.json.
        from megatron_rl.convert.to_hf import mcore_to_hf

        config_only = tmp_path / "config_only"
        config_only.mkdir()
        (config_only / "config.json").write_bytes((tmp_path / "model" / "config.json").read_bytes())
        mcore_to_hf(run / "checkpoints" / "step_00000002", tmp_path / "from_ckpt", hf_config=config_only)
        again = HFWeights(tmp_path / "from_ckpt")
        assert sorted(again) == sorted(new) and all(torch.equal(again[n], new[n]) for n in new)
        return
    assert exported.cfg.model_type == family
    assert any("q_norm" in n or "k_norm" in n for n in changed) or any("experts" in n for n in changed)
    transformers.AutoModelForCausalLM.from_pretrained(run / "hf")


def test_moe_training_at_tp2_without_te_is_refused_before_anything_is_built(tmp_path):
    """Megatron's MoE layer trains at TP > 1 only with sequence parallelism (Transformer Engine
    here): the trainer says so, naming the field, before it builds a process group or a model."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import TrainerConfig
    from megatron_rl.training.model import have_transformer_engine
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.trainer import PolicyTrainer
    from tests.data.tinylm import random_model

    if have_transformer_engine():
        pytest.skip("with Transformer Engine, sequence_parallel makes this layout trainable")
    random_model(tmp_path / "moe", family="qwen3_moe")
    cfg = TrainerConfig(parallel=ParallelConfig(tensor_parallel=2))
    with pytest.raises(ValueError, match=r"trainer.parallel.tensor_parallel: .*sequence_parallel"):
        PolicyTrainer(tmp_path / "moe", cfg, GRPOConfig(), BatchingConfig())
