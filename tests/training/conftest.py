"""Fixtures for the single-process training tests: a one-rank Megatron parallel state."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def single_rank():
    """TP=PP=DP=1 in this process (a one-rank gloo group), torn down after the module."""
    from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

    owned = not dist.is_initialized()
    init_parallel(ParallelConfig(), seed=1234)
    yield
    destroy_parallel(destroy_default_group=owned)
