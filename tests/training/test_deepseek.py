"""DeepSeek-V3 in the trainer: multi-latent attention, a dense first layer, then MoE layers of a
sigmoid router with a score-correction bias, grouped routing and a shared expert (the model of
``tests/hf/test_layout.py``). The trainer's log-probs of a sequence are transformers', an RL step
moves the weights and never the router's bias (a fixed part of the checkpoint: RL does not
rebalance the experts), and the HF export after the step is what transformers loads."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.training.config import OptimConfig, TrainerConfig
from megatron_rl.training.trainer import PolicyTrainer
from megatron_rl.types import TrainBatch, TrainSequence
from tests.hf.test_layout import VOCAB, hf_model


@pytest.mark.distributed
def test_trainer_logprobs_are_transformers_and_a_step_keeps_the_expert_bias(tmp_path):
    import transformers

    reference = hf_model("deepseek_v3", seed=2)
    folder = tmp_path / "hf"
    reference.save_pretrained(folder)
    tokens = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = reference(input_ids=tokens[None]).logits[0, 5:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[6:, None])[:, 0]
    batch = TrainBatch(
        sequences=[
            TrainSequence(
                tokens=tokens,
                prompt_length=6,
                behaviour_logprobs=expected.clone(),
                versions=torch.zeros(8, dtype=torch.long),
                advantage=1.0,
                weight=1.0 / 8,
                group_id=0,
            )
        ]
    )
    trainer = PolicyTrainer(
        folder, TrainerConfig(optim=OptimConfig(lr=1e-2)), GRPOConfig(), BatchingConfig(), vocab_size=VOCAB
    )
    try:
        trainer.load_hf(folder)
        torch.testing.assert_close(trainer.compute_logprobs(batch)[0], expected, atol=1e-5, rtol=0)
        before = {n: t.clone() for n, t in trainer.hf_tensors()}
        metrics = trainer.rl_step(batch)
        assert metrics["skipped"] == 0.0
        after = dict(trainer.hf_tensors())
        bias = [n for n in after if n.endswith("e_score_correction_bias")]
        assert bias and all(torch.equal(after[n], before[n]) for n in bias)
        moved = [n for n in after if not torch.equal(after[n], before[n])]
        assert any("kv_a_proj_with_mqa" in n for n in moved) and any("shared_experts" in n for n in moved)
        trainer.export_hf(tmp_path / "out", like=folder)
    finally:
        trainer.close()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
