"""ParallelConfig validation and init_parallel's checks (one rank)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigFieldError
from megatron_rl.training.parallel import ParallelConfig, init_parallel


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tensor_parallel=0), "tensor_parallel"),
        (dict(pipeline_parallel=0), "pipeline_parallel"),
        (dict(pipeline_parallel=2, virtual_pipeline=1), "virtual_pipeline"),
        (dict(virtual_pipeline=2), "virtual_pipeline"),  # interleaving without a pipeline
        (dict(sequence_parallel=True), "sequence_parallel"),  # without TP
        (dict(backend="mpi"), "backend"),
    ],
)
def test_invalid_layouts_name_the_field(kwargs, field):
    with pytest.raises(ConfigFieldError) as err:
        ParallelConfig(**kwargs)
    assert err.value.field == field


def test_valid_layout_and_backend():
    cfg = ParallelConfig(tensor_parallel=2, pipeline_parallel=4, virtual_pipeline=2, sequence_parallel=True)
    assert cfg.model_parallel_size == 8
    assert ParallelConfig().resolved_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert ParallelConfig(backend="gloo").resolved_backend() == "gloo"


def test_world_size_must_fit_the_layout(single_rank):
    with pytest.raises(ValueError, match="not a multiple"):
        init_parallel(ParallelConfig(tensor_parallel=2), seed=0)
    with pytest.raises(RuntimeError, match="already initialised"):
        init_parallel(ParallelConfig(), seed=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal of nccl")
def test_nccl_needs_cuda():
    with pytest.raises(ValueError, match="nccl"):
        init_parallel(ParallelConfig(backend="nccl"), seed=0)
