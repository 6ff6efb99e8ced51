"""Non-finite steps: a NaN/inf loss or gradient norm skips the step on every rank and changes
nothing (weights, Adam state, LR schedule compared tensor by tensor); ``max_nonfinite_steps``
skips in a row raise NonFiniteError; a finite step resets the count. A real PolicyTrainer on a
tiny Llama, single process (the ``single_rank`` fixture), and one spawn of 2 gloo ranks (DP2)
where only rank 1's gradients turn NaN after the data-parallel reduction: both ranks must skip.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.training import NonFiniteError
from megatron_rl.training.checkpoint import _inner_optimizers
from megatron_rl.training.config import OptimConfig, TrainerConfig
from megatron_rl.types import TrainBatch, TrainSequence
from tests.spawn import run_ranks

VOCAB = 100  # padded to 1024 by the model


def _trainer(max_nonfinite_steps: int = 3):
    from megatron_rl.training.trainer import PolicyTrainer

    hf = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    return PolicyTrainer(
        hf,
        TrainerConfig(
            # warm-up, so a scheduler step that should not have happened shows in the lr
            optim=OptimConfig(lr=1e-3, warmup_steps=4, weight_decay=0.01),
            max_nonfinite_steps=max_nonfinite_steps,
        ),
        GRPOConfig(),
        BatchingConfig(token_budget=64),
    )


def _batch(seed: int, advantage: float | None = None) -> TrainBatch:
    """Six random sequences; ``advantage`` (NaN, inf) replaces the third one's."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(6):
        p, c = 3 + i % 3, 4 + i % 4
        seqs.append(
            TrainSequence(
                tokens=torch.randint(0, VOCAB, (p + c,), generator=g),
                prompt_length=p,
                behaviour_logprobs=-math.log(VOCAB) + 0.1 * torch.randn(c, generator=g),
                versions=torch.zeros(c, dtype=torch.long),
                advantage=advantage
                if advantage is not None and i == 2
                else float(torch.randn(1, generator=g)),
                weight=0.05,
                group_id=i // 3,
            )
        )
    return TrainBatch(sequences=seqs)


def _state(trainer) -> dict[str, object]:
    """Everything a step may change: weights, Adam's state (moments, step), the scheduler."""
    out: dict[str, object] = {
        f"param {n}": p.detach().clone() for n, p in trainer.chunks[0].named_parameters()
    }
    for i, inner in enumerate(_inner_optimizers(trainer.optimizer)):
        for j, state in enumerate(inner.optimizer.state.values()):
            for key, value in state.items():
                out[f"adam {i}.{j}.{key}"] = value.clone() if torch.is_tensor(value) else value
        for j, group in enumerate(inner.optimizer.param_groups):
            out[f"group {i}.{j}"] = {k: v for k, v in group.items() if k != "params"}
    out["scheduler"] = dict(trainer.scheduler.state_dict())
    out["step"], out["lr"] = trainer.step, trainer.lr
    return out


def _assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _grads_are_zero(trainer) -> bool:
    return all(not p.main_grad.any() for p in trainer.chunks[0].parameters())


@pytest.mark.fault("numeric")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_loss_skips_the_step_and_changes_nothing(single_rank, bad):
    trainer = _trainer()
    taken = trainer.rl_step(_batch(0))  # Adam has state now: a skipped step must not touch it
    assert taken["skipped"] == 0.0 and taken["nonfinite_steps"] == 0.0
    before = _state(trainer)
    metrics = trainer.rl_step(_batch(1, advantage=bad))
    _assert_same(_state(trainer), before)
    assert _grads_are_zero(trainer)
    assert metrics["skipped"] == 1.0 and metrics["update_successful"] == 0.0
    assert (metrics["nonfinite_loss"], metrics["nonfinite_steps"], metrics["nonfinite_in_a_row"]) == (1, 1, 1)
    assert "loss" not in metrics and all(math.isfinite(v) for v in metrics.values())
    assert metrics["step"] == 1.0 and metrics["lr"] == before["lr"]
    # The next finite step is step 2, at step 2's learning rate (the warm-up did not advance).
    after = trainer.rl_step(_batch(2))
    assert after["skipped"] == 0.0 and after["step"] == 2.0 and after["nonfinite_steps"] == 1.0
    assert after["lr"] == pytest.approx(1e-3 * 2 / 4)
    trainer.close()


@pytest.mark.fault("numeric")
def test_nan_gradient_with_a_finite_loss_is_skipped(single_rank):
    trainer = _trainer()
    trainer.rl_step(_batch(0))
    before = _state(trainer)
    param = next(trainer.chunks[0].parameters())
    hook = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    metrics = trainer.rl_step(_batch(1))
    hook.remove()
    _assert_same(_state(trainer), before)
    assert _grads_are_zero(trainer)
    assert (metrics["nonfinite_loss"], metrics["nonfinite_grad_norm"]) == (0.0, 1.0)
    assert math.isfinite(metrics["loss"]) and "grad_norm" not in metrics
    trainer.close()


@pytest.mark.fault("numeric")
def test_max_nonfinite_steps_in_a_row_raise_and_a_finite_step_resets_the_count(single_rank):
    trainer = _trainer(max_nonfinite_steps=3)
    trainer.rl_step(_batch(0))
    for _ in range(2):
        assert trainer.rl_step(_batch(1, advantage=float("nan")))["skipped"] == 1.0
    assert trainer.rl_step(_batch(2))["skipped"] == 0.0  # resets the count: two more are fine
    for _ in range(2):
        assert trainer.rl_step(_batch(1, advantage=float("nan")))["nonfinite_in_a_row"] <= 2
    before = _state(trainer)
    with pytest.raises(NonFiniteError) as err:
        trainer.rl_step(_batch(1, advantage=float("nan")))
    message = str(err.value)
    assert "step 3: loss is nan" in message and "3 steps in a row" in message, message
    assert "max_nonfinite_steps = 3" in message and "weights are those after step 2" in message
    assert isinstance(err.value, RuntimeError)
    _assert_same(_state(trainer), before)  # raising changed nothing either
    assert trainer.nonfinite_steps == 5
    trainer.close()


# -- data parallel: every rank skips when one rank's gradients are NaN ----------------------------


def _dp_run(rank: int, world_size: int) -> dict:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU test by design, also where a GPU is present
    trainer = _trainer()
    try:
        trainer.rl_step(_batch(0))
        before = _state(trainer)
        config = trainer.model[0].config
        reduce_grads = config.finalize_model_grads_func

        def poisoned(*args, **kwargs):
            # After the data-parallel all-reduce: rank 1's grads alone turn NaN, so its grad norm
            # alone is NaN (the norm is reduced over the model-parallel group only, size 1 here).
            reduce_grads(*args, **kwargs)
            if rank == 1:
                next(trainer.chunks[0].parameters()).main_grad.fill_(float("nan"))

        config.finalize_model_grads_func = poisoned
        metrics = trainer.rl_step(_batch(1))
        config.finalize_model_grads_func = reduce_grads
        unchanged = True
        try:
            _assert_same(_state(trainer), before)
        except AssertionError:
            unchanged = False
        after = trainer.rl_step(_batch(2))
        weights = torch.cat([p.detach().flatten() for p in trainer.chunks[0].parameters()])
        return {"metrics": metrics, "unchanged": unchanged, "after": after, "weights": weights}
    finally:
        trainer.close()


@pytest.mark.distributed
@pytest.mark.fault("numeric")
def test_data_parallel_ranks_agree_to_skip():
    ranks = run_ranks(_dp_run, 2, timeout=180)
    for r in ranks:
        assert r["metrics"]["skipped"] == 1.0 and r["metrics"]["nonfinite_grad_norm"] == 1.0
        assert r["unchanged"] and r["after"]["skipped"] == 0.0 and r["after"]["step"] == 2.0
    # Without the agreement rank 0 would have stepped alone and the replicas would have split.
    timeless = [{k: v for k, v in r["metrics"].items() if k != "step_time_s"} for r in ranks]
    assert timeless[0] == timeless[1]
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
