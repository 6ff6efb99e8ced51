import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms.logprobs import naive_token_logprobs, token_logprobs
from tests.spawn import run_ranks


def test_uniform_logits_by_hand():
    logp, ent = token_logprobs(torch.zeros(3, 4), torch.tensor([0, 1, 3]))
    torch.testing.assert_close(logp, torch.full((3,), -math.log(4)))
    torch.testing.assert_close(ent, torch.full((3,), math.log(4)))


def test_two_word_vocabulary_by_hand():
    # p = softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    logp, ent = token_logprobs(logits, torch.tensor([1]))
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75)]))
    torch.testing.assert_close(ent, torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    v=st.integers(2, 300),
    chunk=st.integers(1, 17),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    seed=st.integers(0, 10_000),
)
@example(n=9, v=3, chunk=1, temperature=0.7, seed=9)  # the gradient differs by 1.34e-6 (fp32 ulps)
def test_matches_naive_forward_and_backward(n, v, chunk, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    logp, ent = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref_logp, ref_ent = naive_token_logprobs(ref_logits, targets, temperature=temperature)
    (ref_grad,) = torch.autograd.grad((ref_logp * upstream).sum(), ref_logits)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    # fp32: the chunked softmax's gradient and the naive one round differently by a few ulps of
    # the upstream gradient's scale (|upstream| reaches ~3): 1.34e-6 found by hypothesis.
    torch.testing.assert_close(grad, ref_grad, atol=3e-6, rtol=1e-5)
    assert not ent.requires_grad


def test_leading_dimensions_and_bf16():
    logits = torch.randn(2, 5, 64).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 64, (2, 5))
    logp, _ent = token_logprobs(logits, targets, chunk_size=3)
    assert logp.shape == (2, 5) and logp.dtype == torch.float32
    ref, _ref_ent = naive_token_logprobs(logits.detach(), targets)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.shape == logits.shape


def test_masked_vocabulary_entries():
    # -inf logits (masked / padded vocabulary) take no probability and do not poison the entropy.
    logits = torch.tensor([[0.0, 0.0, -float("inf"), -float("inf")]])
    logp, ent = token_logprobs(logits, torch.tensor([1]))
    torch.testing.assert_close(logp, torch.tensor([-math.log(2)]))
    torch.testing.assert_close(ent, torch.tensor([math.log(2)]))


def test_bad_targets_and_temperature():
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        token_logprobs(torch.zeros(2, 8), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 8), torch.tensor([0, 1]), temperature=0)
    with pytest.raises(ValueError, match="match"):
        token_logprobs(torch.zeros(2, 8), torch.tensor([0, 1, 2]))


def _vocab_parallel_rank(rank, world_size, n, vocab, chunk):
    g = torch.Generator().manual_seed(1234)
    full = torch.randn(n, vocab, generator=g) * 3
    full[:, -3:] = -float("inf")  # padded vocabulary entries on the last shard
    targets = torch.randint(0, vocab - 3, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    shard = vocab // world_size
    local = full[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()

    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        logp, ent = token_logprobs(local, targets, chunk_size=chunk, tp_group=dist.group.WORLD)
        (logp * upstream).sum().backward()
    finally:
        dist.all_reduce = real_all_reduce
    return logp.detach(), ent, local.grad, calls


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_equals_single_device(world_size):
    n, vocab, chunk = 9, 64, 4
    results = run_ranks(_vocab_parallel_rank, world_size, args=(n, vocab, chunk))
    g = torch.Generator().manual_seed(1234)
    full = torch.randn(n, vocab, generator=g) * 3
    full[:, -3:] = -float("inf")
    targets = torch.randint(0, vocab - 3, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    full.requires_grad_()
    ref_logp, ref_ent = token_logprobs(full, targets)
    (ref_logp * upstream).sum().backward()
    shard = vocab // world_size
    for rank, (logp, ent, grad, calls) in enumerate(results):
        torch.testing.assert_close(logp, ref_logp.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            grad, full.grad[:, rank * shard : (rank + 1) * shard], atol=1e-6, rtol=1e-6
        )
        # One MAX of [N] and one SUM of the stacked [3, N]: per-token scalars only, no vocab gather.
        assert calls == [(n,), (3, n)]


def test_input_logits_are_not_modified():
    logits = torch.randn(6, 10, requires_grad=True)
    before = logits.detach().clone()
    logp, _ = token_logprobs(logits, torch.randint(0, 10, (6,)), temperature=0.5, chunk_size=4)
    logp.sum().backward()
    assert torch.equal(logits.detach(), before)
