"""The batch builder end to end, and the invariance the whole design rests on: the loss and its
gradient do not depend on how a minibatch is split into microbatches or data-parallel ranks."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.algorithms.logprobs import token_logprobs
from megatron_rl.algorithms.loss import grpo_loss
from megatron_rl.batching.builder import build_train_batch
from megatron_rl.batching.collate import build_microbatches, collate
from megatron_rl.batching.dp import assign_data_parallel
from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

VOCAB = 23


def make_group(gid, prompt_len, completion_lens, rewards, gen, correct=None):
    prompt = Prompt(
        prompt_id=f"p{gid}", token_ids=torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
    )
    completions = []
    for i, (n, r) in enumerate(zip(completion_lens, rewards)):
        c = Completion(
            prompt_id=prompt.prompt_id,
            sample_index=i,
            token_ids=torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
            logprobs=[-1.0] * n,
            versions=[0] * n,
        )
        completions.append(
            ScoredCompletion(
                completion=c, reward=r, correct=None if correct is None else correct[i], format_ok=True
            )
        )
    return Group(prompt=prompt, completions=completions)


def test_builder_by_hand():
    gen = torch.Generator().manual_seed(0)
    groups = [
        make_group(0, 3, [2, 6], [1.0, 0.0], gen, correct=[True, False]),
        make_group(1, 2, [4, 4], [1.0, 1.0], gen, correct=[True, True]),  # dropped: all correct
        make_group(2, 4, [1, 3], [0.0, 0.5], gen, correct=[False, False]),
    ]
    batch = build_train_batch(groups, GRPOConfig())
    assert [s.group_id for s in batch.sequences] == [0, 0, 2, 2]
    assert batch.filter_report.dropped["all_correct"] == 1
    # centred: [0.5, -0.5, -0.25, 0.25] -> std sqrt(0.15625)
    std = math.sqrt((2 * 0.25 + 2 * 0.0625) / 4)
    assert [s.advantage for s in batch.sequences] == pytest.approx(
        [0.5 / std, -0.5 / std, -0.25 / std, 0.25 / std], rel=1e-5
    )
    # two kept groups of 8 and 4 tokens: weights 1/16 and 1/8
    assert [s.weight for s in batch.sequences] == pytest.approx([1 / 16, 1 / 16, 1 / 8, 1 / 8])
    s0 = batch.sequences[0]
    assert s0.prompt_length == 3 and s0.completion_length == 2
    assert s0.tokens[:3].tolist() == groups[0].prompt.token_ids


def test_dropped_groups_contribute_exactly_nothing():
    gen = torch.Generator().manual_seed(1)
    kept = make_group(0, 3, [2, 5, 3], [1.0, 0.0, 0.1], gen)
    same = make_group(1, 2, [7, 1, 2], [0.0, 0.0, 0.0], gen)
    with_dropped = build_train_batch([kept, same], GRPOConfig())
    alone = build_train_batch([kept], GRPOConfig())
    assert len(with_dropped) == len(alone) == 3
    for a, b in zip(with_dropped.sequences, alone.sequences):
        assert torch.equal(a.tokens, b.tokens) and a.advantage == b.advantage and a.weight == b.weight


class TinyCausalLM(torch.nn.Module):
    """One attention layer that honours the microbatch's mask and positions, so a wrong packing
    (attention across sequences, positions not restarting) changes the result."""

    def __init__(self, vocab=VOCAB, dim=12, max_pos=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_pos, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, position_ids, mask):
        x = self.emb(tokens) + self.pos(position_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(mask[:, 0], -float("inf"))
        return self.out(torch.softmax(scores, -1) @ v + x)


def microbatch_loss(model, mb, cfg):
    logits = model(mb.tokens, mb.position_ids, mb.attention_mask())
    logp, entropy = token_logprobs(logits, mb.labels, chunk_size=7)
    return grpo_loss(
        logp,
        mb.behaviour_logprobs,
        mb.advantages,
        mb.loss_weights,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        entropy=entropy,
    )


def loss_and_grads(model, microbatches, cfg):
    model.zero_grad(set_to_none=False)
    total = 0.0
    for mb in microbatches:
        loss, _ = microbatch_loss(model, mb, cfg)
        loss.backward()  # gradient accumulation, as the pipeline schedule does
        total += loss.item()
    return total, [p.grad.clone() for p in model.parameters()]


@settings(max_examples=25, deadline=None)
@given(
    spec=st.lists(
        st.tuples(
            st.integers(1, 6),
            st.lists(st.tuples(st.integers(1, 9), st.sampled_from([0.0, 0.1, 1.0])), min_size=2, max_size=4),
        ),
        min_size=1,
        max_size=5,
    ),
    extra_budget=st.integers(0, 40),
    layout=st.sampled_from(["packed", "padded"]),
    strategy=st.sampled_from(["greedy", "uniform"]),
    dp=st.integers(1, 3),
    loss_norm=st.sampled_from(["group", "token", "sequence"]),
    seed=st.integers(0, 1000),
)
def test_loss_and_gradient_do_not_depend_on_the_split(
    spec, extra_budget, layout, strategy, dp, loss_norm, seed
):
    gen = torch.Generator().manual_seed(seed)
    groups = [
        make_group(g, p, [n for n, _ in comps], [r for _, r in comps], gen)
        for g, (p, comps) in enumerate(spec)
    ]
    cfg = GRPOConfig(loss_norm=loss_norm)
    batch = build_train_batch(groups, cfg)
    assume(len(batch) > 0)
    torch.manual_seed(seed)
    model = TinyCausalLM()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a rank with no sequence still contributes (zero) gradients
    # Behaviour log-probs near the model's own, so ratios spread around 1 and some get clipped.
    with torch.no_grad():
        for i, s in enumerate(batch.sequences):
            mb = collate([s], [i], layout="padded")
            logp, _ = token_logprobs(model(mb.tokens, mb.position_ids, mb.attention_mask()), mb.labels)
            (own,) = mb.split_per_sequence(logp)
            s.behaviour_logprobs = own + 0.3 * torch.randn(own.shape, generator=gen)

    whole = [collate(batch.sequences, list(range(len(batch))), layout="packed")]
    ref_loss, ref_grads = loss_and_grads(model, whole, cfg)

    budget = max(batch.lengths) + extra_budget
    split_loss, split_grads = 0.0, [torch.zeros_like(g) for g in ref_grads]
    for rank_indices in assign_data_parallel(batch.lengths, dp, seed=seed):
        mbs = build_microbatches(batch.subset(rank_indices), budget, layout=layout, strategy=strategy)
        loss, grads = loss_and_grads(model, mbs, cfg)
        split_loss += loss
        split_grads = [a + b for a, b in zip(split_grads, grads)]  # what a sum all-reduce gives

    assert abs(split_loss - ref_loss) <= 1e-6
    for a, b in zip(split_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
