"""MoE routing replay (R3): the trainer's routers take the experts the engine routed each token to.

A tiny random Qwen3-MoE (8 experts, top 2, renormalised) generates with the built-in engine, which
records every fed position's experts. The trainer, holding the same weights, computes the
completion's log-probs: with the recorded experts they equal the engine's within 1e-5. Then one
expert's router row is changed in the trainer only -- an expert the engine never chose in that
layer, made to win wherever the most chosen expert's logit is positive: without replay the
trainer routes tokens to it and its log-probs move; with replay the replayed experts' weights
come from the same logits as before, and the log-probs still equal the engine's.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.generation.engine import Engine, EngineConfig
from megatron_rl.training.config import TrainerConfig
from megatron_rl.training.trainer import PolicyTrainer
from megatron_rl.types import TrainBatch, TrainSequence
from tests.hf.test_layout import VOCAB, hf_model


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    hf_model("qwen3_moe", seed=3, num_experts=8).save_pretrained(folder)
    return folder


def _generate(folder) -> tuple[list[int], list[int], list[float], torch.Tensor]:
    engine = Engine.from_pretrained(folder, EngineConfig(max_slots=2, max_len=64))
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, max_new_tokens=10, temperature=1.0, seed=1, return_routed_experts=True)
    (out,) = engine.generate_all()
    return prompt, out.token_ids, out.logprobs, out.routed_experts


def _batch(prompt, tokens, logprobs, routed) -> TrainBatch:
    return TrainBatch(
        sequences=[
            TrainSequence(
                tokens=torch.tensor(prompt + tokens),
                prompt_length=len(prompt),
                behaviour_logprobs=torch.tensor(logprobs),
                versions=torch.zeros(len(tokens), dtype=torch.long),
                advantage=1.0,
                weight=1.0,
                group_id=0,
                routed_experts=routed,
            )
        ]
    )


@pytest.mark.distributed
def test_replayed_routing_gives_the_engines_logprobs_after_the_router_moves(moe_folder):
    prompt, tokens, engine_lp, routed = _generate(moe_folder)
    trainer = PolicyTrainer(
        moe_folder, TrainerConfig(), GRPOConfig(routing_replay="rollout"), BatchingConfig(), vocab_size=VOCAB
    )
    try:
        trainer.load_hf(moe_folder)
        expected = torch.tensor(engine_lp)
        replayed = _batch(prompt, tokens, engine_lp, routed)
        own = _batch(prompt, tokens, engine_lp, None)  # the trainer's own routing
        torch.testing.assert_close(trainer.compute_logprobs(replayed)[0], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(trainer.compute_logprobs(own)[0], expected, atol=1e-5, rtol=0)
        # Layer 1: an expert the engine never chose gets the router row of the most chosen one,
        # scaled up: it now outranks it wherever that expert's logit is positive.
        used = routed[:, 1].flatten().bincount(minlength=8)
        unused, busiest = int(used.argmin()), int(used.argmax())
        assert used[unused] == 0, "the test needs an expert the engine never chose in layer 1"
        weight = dict(trainer.chunks[0].named_parameters())["decoder.layers.1.mlp.router.weight"]
        with torch.no_grad():
            weight[unused] = 4.0 * weight[busiest]
        moved = trainer.compute_logprobs(own)[0]
        assert (moved - expected).abs().max() > 1e-3  # routed elsewhere: the log-probs differ
        torch.testing.assert_close(trainer.compute_logprobs(replayed)[0], expected, atol=1e-5, rtol=0)
    finally:
        trainer.close()


def _pipeline_ranks(rank: int, world: int, folder: str, generated: tuple) -> list[list[float]]:
    """At PP=2 (one layer a stage): the log-probs with replay, after moving layer 1's router on
    the stage that holds it, and without replay."""
    import os

    from megatron_rl.training.parallel import ParallelConfig

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    prompt, tokens, engine_lp, routed, unused, busiest = generated
    trainer = PolicyTrainer(
        folder,
        TrainerConfig(parallel=ParallelConfig(pipeline_parallel=2)),
        GRPOConfig(routing_replay="rollout"),
        BatchingConfig(),
        vocab_size=VOCAB,
    )
    try:
        trainer.load_hf(folder)
        params = dict(trainer.chunks[0].named_parameters())
        if rank == 1:  # the second stage numbers its one layer 0; it is global layer 1
            weight = params["decoder.layers.0.mlp.router.weight"]
            with torch.no_grad():
                weight[unused] = 4.0 * weight[busiest]
        replayed = trainer.compute_logprobs(_batch(prompt, tokens, engine_lp, routed))[0]
        own = trainer.compute_logprobs(_batch(prompt, tokens, engine_lp, None))[0]
        return [replayed.tolist(), own.tolist()]
    finally:
        trainer.close()


@pytest.mark.distributed
def test_replay_finds_each_layer_on_its_pipeline_stage(moe_folder):
    """Each stage's routers take their *global* layer's experts (stage 1's local layer 0 is
    layer 1)."""
    from tests.spawn import run_ranks

    prompt, tokens, engine_lp, routed = _generate(moe_folder)
    used = routed[:, 1].flatten().bincount(minlength=8)
    unused, busiest = int(used.argmin()), int(used.argmax())
    assert used[unused] == 0
    results = run_ranks(
        _pipeline_ranks,
        2,
        args=(str(moe_folder), (prompt, tokens, engine_lp, routed, unused, busiest)),
        timeout=240,
    )
    expected = torch.tensor(engine_lp)
    for replayed, own in results:  # every rank gets the batch's log-probs
        torch.testing.assert_close(torch.tensor(replayed), expected, atol=1e-5, rtol=0)
        assert (torch.tensor(own) - expected).abs().max() > 1e-3


def test_routing_replay_needs_experts_and_no_recompute(tmp_path, moe_folder):
    """Refused before any process group or model is built, naming the field."""
    dense = tmp_path / "dense"
    hf_model("qwen3").save_pretrained(dense)
    with pytest.raises(ValueError, match="algorithm.routing_replay: .*no experts"):
        PolicyTrainer(dense, TrainerConfig(), GRPOConfig(routing_replay="rollout"), BatchingConfig())
    with pytest.raises(ValueError, match="algorithm.routing_replay: .*trainer.recompute"):
        PolicyTrainer(
            moe_folder, TrainerConfig(recompute=True), GRPOConfig(routing_replay="rollout"), BatchingConfig()
        )


def test_tokens_decoded_across_a_router_update_keep_the_experts_actually_used(moe_folder):
    """The engine records routing as it routes: a sequence decoded across a change of the last
    layer's router (its K/V do not depend on it) reports the old experts for the positions fed
    before the change and the new ones after, each equal to a full forward under those weights."""
    from megatron_rl.generation.engine import Decoder

    engine = Engine.from_pretrained(moe_folder, EngineConfig(max_slots=1, max_len=64))
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request("r", prompt, max_new_tokens=12, temperature=1.0, seed=2, return_routed_experts=True)
    for _ in range(5):  # the prompt and five generated tokens are fed (two tokens in the first step)
        engine.step()
    switch = len(prompt) + 5  # the first position fed under the new router
    gate = engine.model.named_weights()["model.layers.1.mlp.gate.weight"]
    old = gate.clone()
    with torch.no_grad():
        gate.copy_(torch.randn(old.shape, generator=torch.Generator().manual_seed(5)))
    (out,) = engine.generate_all()
    fed = torch.tensor([prompt + out.token_ids[:-1]])

    def routing(weight: torch.Tensor) -> torch.Tensor:
        model = Decoder.from_pretrained(moe_folder)
        model.named_weights()["model.layers.1.mlp.gate.weight"].copy_(weight)
        model.full_logits(fed)
        return model.last_routed[0].sort(dim=-1).values

    before, after = routing(old), routing(gate)
    got = out.routed_experts.sort(dim=-1).values
    assert not torch.equal(before[switch:, 1], after[switch:, 1])  # the update moved the routing
    assert torch.equal(got[:switch], before[:switch])
    assert torch.equal(got[switch:], after[switch:])
