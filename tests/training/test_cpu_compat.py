"""The CPU adaptation of Megatron-Core: idempotent, narrow, and each redirection does its job."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_rl.training import cpu_compat

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cpu_compat applies only where CUDA is absent"
)


def test_apply_is_idempotent():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import random as mrandom

    assert cpu_compat.apply_cpu_compat() is True
    wrapped_init, tracker_cls = DistributedOptimizer.__init__, mrandom.CudaRNGStatesTracker
    assert cpu_compat.apply_cpu_compat() is True
    assert cpu_compat.cpu_compat_applied()
    # Nothing is wrapped twice.
    assert DistributedOptimizer.__init__ is wrapped_init
    assert mrandom.CudaRNGStatesTracker is tracker_cls


def test_only_listed_megatron_modules_see_the_stand_in():
    cpu_compat.apply_cpu_compat()
    for name in cpu_compat.PATCHED_MODULES:
        assert importlib.import_module(name).torch is not torch, name
    assert importlib.import_module("megatron.core.tensor_parallel.random").torch is torch
    # The real torch is untouched: CUDA calls still fail outside Megatron ...
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    # ... and CPU tensors still report CPU type names.
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert "type" not in torch.Tensor.__dict__ and "cuda" not in torch.Tensor.__dict__


def test_cuda_allocations_land_on_cpu():
    cpu_compat.apply_cpu_compat()
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    mask = get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")
    assert buf.device.type == "cpu" and buf.shape == (2, 3)


def test_cuda_type_names_only_inside_the_scope():
    t = torch.zeros(2)
    with cpu_compat._cpu_tensors_pass_as_cuda():
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions still convert
        assert t.cuda() is t
        with cpu_compat._cpu_tensors_pass_as_cuda():  # re-entrant
            assert t.type() == "torch.cuda.FloatTensor"
        assert t.type() == "torch.cuda.FloatTensor"
    assert t.type() == "torch.FloatTensor"
    assert "type" not in torch.Tensor.__dict__ and "cuda" not in torch.Tensor.__dict__


def test_rng_tracker_forks_the_cpu_generator(single_rank):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)

    def draws(seed: int) -> tuple[torch.Tensor, ...]:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        with tracker.fork():
            forked = torch.rand(4)
        after = torch.rand(4)
        with tracker.fork():
            forked_again = torch.rand(4)
        return forked, after, forked_again

    forked, after, forked_again = draws(5)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(4))  # the default stream did not move inside fork()
    assert not torch.equal(forked, after)  # the fork is a different stream ...
    assert not torch.equal(forked, forked_again)  # ... that continues where it left off
    assert all(torch.equal(a, b) for a, b in zip(draws(5), draws(5)))  # and is reproducible


def test_activation_checkpointing_replays_the_rng(single_rank):
    """Recomputation in backward must redraw the same dropout mask (RNG state saved/restored)."""
    from megatron.core import tensor_parallel

    def block(x: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x * 3.0, p=0.5, training=True)

    tensor_parallel.model_parallel_cuda_manual_seed(11)
    x1 = torch.randn(64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    state = (torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())
    y1 = block(x1)
    y1.sum().backward()
    torch.set_rng_state(state[0])
    tensor_parallel.get_cuda_rng_tracker().set_states(state[1])
    y2 = tensor_parallel.checkpoint(block, False, x2)
    torch.rand(8)  # move the generators between forward and the recomputing backward
    y2.sum().backward()
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    assert 0 < (x1.grad == 0).sum() < 64  # dropout did drop something
