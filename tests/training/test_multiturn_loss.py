"""A multi-turn batch through the real trainer (TP1 x DP2, gloo): the loss and every gradient equal
an independent reference that masks the environment's tokens and normalises each group by its
model tokens only -- computed here by hand from the trajectories, not from the batch's weights."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.spawn import run_ranks
from tests.training.test_layouts import _global_names, _max_diff
from tests.training.test_trainer import EPS_HIGH, EPS_LOW, PACKED, PADDED, VOCAB, _hf_config, _sequence_terms

TOL = 1e-6  # absolute, on the loss and on every gradient entry (fp32 sums in another order)


def _groups(seed: int = 3):
    """Groups of 3-turn trajectories: model turns of 2-6 tokens, environment turns of 3-8, rewards spread."""
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    g = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    groups = []
    for gi in range(4):
        prompt = Prompt(
            prompt_id=f"p{gi}", token_ids=torch.randint(0, VOCAB, (rand(3, 8),), generator=g).tolist()
        )
        scored = []
        for k in range(3):
            ids, mask, logprobs, versions = [], [], [], []
            for turn in range(3):
                n = rand(2, 7)
                ids += torch.randint(0, VOCAB, (n,), generator=g).tolist()
                mask += [True] * n
                logprobs += (-math.log(VOCAB) + 0.3 * torch.randn(n, generator=g)).tolist()
                versions += [turn] * n  # the trajectory spans weight updates
                if turn < 2:
                    e = rand(3, 9)
                    ids += torch.randint(0, VOCAB, (e,), generator=g).tolist()
                    mask += [False] * e
                    logprobs += [0.0] * e
                    versions += [-1] * e
            comp = Completion(
                prompt_id=prompt.prompt_id,
                sample_index=k,
                token_ids=ids,
                logprobs=logprobs,
                versions=versions,
                loss_mask=mask,
            )
            scored.append(ScoredCompletion(completion=comp, reward=float(gi + k) / 7.0))
        groups.append(Group(prompt=prompt, completions=scored))
    return groups


def _batch():
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch

    return build_train_batch(_groups(), GRPOConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH))


def _reference(model) -> dict:
    """The minibatch loss by hand: per token ``-min(r A, clip(r) A)`` on model tokens only, each
    group's sum divided by its model-token count, the groups averaged."""
    groups, batch = _groups(), _batch()
    completions = [sc.completion for grp in groups for sc in grp.completions]
    assert len(batch.sequences) == len(completions)  # spread rewards: nothing dropped
    group_tokens = [sum(sum(sc.completion.loss_mask) for sc in grp.completions) for grp in groups]
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for i, (s, c) in enumerate(zip(batch.sequences, completions, strict=True)):
        logp, _entropy = _sequence_terms(model, s)
        mask = torch.tensor(c.loss_mask)
        ratio = torch.exp(logp - torch.tensor(c.logprobs))
        adv = torch.tensor(s.advantage)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        total = total + per_token[mask].sum() / (len(groups) * group_tokens[i // 3])
    total.backward()
    return {"loss": total.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _run(rank: int, world_size: int, ckpt: str) -> list[dict]:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import TrainerConfig
    from megatron_rl.training.model import build_gpt_model, load_model_checkpoint, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, parallel_layout
    from megatron_rl.training.trainer import PolicyTrainer

    with parallel_layout(ParallelConfig(), seed=1234):
        model = build_gpt_model(_hf_config(False), ParallelConfig())  # the same on every rank (seeded)
        save_model_checkpoint(model, ckpt)
        ref = _reference(model)
        trainer = PolicyTrainer(
            _hf_config(False),
            TrainerConfig(),
            GRPOConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH),
            BatchingConfig(**PACKED),
        )
        load_model_checkpoint(trainer.model, ckpt)
        trainer.optimizer.reload_model_params()
        names = [_global_names(c, False) for c in trainer.model]
        diffs = {}
        for rows, b in (("packed", PACKED), ("padded", PADDED)):
            got = trainer.forward_backward(_batch(), "grpo", batching=BatchingConfig(**b))
            diffs[f"{rows} loss"] = (abs(got["loss"] - ref["loss"]), abs(ref["loss"]))
            for chunk, chunk_names in zip(trainer.chunks, names):
                for local, p in chunk.named_parameters():
                    diffs[f"{rows} grad {chunk_names[local]}"] = _max_diff(
                        p.main_grad, ref["grads"][chunk_names[local]]
                    )
    return [{"layout": "dp2", "diffs": diffs}]


@pytest.mark.distributed
def test_multi_turn_loss_and_gradients_equal_the_masked_reference():
    from tests.training.compare import diff_failures

    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_run, 2, args=(f"{root}/ckpt",), timeout=240)
    bad, compared = diff_failures(per_rank, lambda what, scale: TOL, require_scale=True)
    assert not bad, "\n".join(bad)
    assert compared["dp2"] >= 2 * 2 * 10, compared


def test_the_batch_weights_count_model_tokens_only():
    batch = _batch()
    groups = _groups()
    seqs = iter(batch.sequences)
    for grp in groups:
        model_tokens = sum(sum(sc.completion.loss_mask) for sc in grp.completions)
        for sc in grp.completions:
            s = next(seqs)
            assert s.weight == pytest.approx(1.0 / (len(groups) * model_tokens), rel=1e-12)
            assert s.loss_mask is not None and s.loss_mask.tolist() == sc.completion.loss_mask
    # Every loss weight of the batch sums to one over the model's tokens, and is 0 elsewhere.
    total = sum(s.weight * int(s.loss_mask.sum()) for s in batch.sequences if s.loss_mask is not None)
    assert total == pytest.approx(1.0, rel=1e-12)
