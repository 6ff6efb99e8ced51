"""Parallel layout of the trainer (TP x PP x CP x DP, and EP for MoE experts) and Megatron-Core's process groups.

Launch (GPU, NCCL)::

    torchrun --nproc-per-node 8 -m megatron_rl.<verb> ...   # init_parallel reads RANK/WORLD_SIZE/...

On a CPU machine the same code runs over gloo; tests start their ranks with ``tests/spawn.py`` and
call :func:`init_parallel` inside an already-initialised default group. A lone process with no
torchrun environment gets a one-rank group of its own, so a model can be built in a notebook.

Data parallel size is not configured: it is ``world_size / (tensor_parallel * pipeline_parallel *
context_parallel)``. Context parallelism (CP) splits every sequence of a micro-batch over
``context_parallel`` ranks (Megatron's load-balanced zig-zag chunks, ``batching/collate.py``
``split_for_context_parallel``); the weights are replicated over them like data-parallel ranks,
and their gradients are summed over data- and context-parallel ranks together.
Expert parallelism splits each MoE layer's experts over ``expert_parallel`` ranks taken from the
data-parallel ranks (Megatron's expert grid: every other weight stays replicated over them), so
``expert_parallel`` must divide the data-parallel size.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.training.cpu_compat import apply_cpu_compat

__all__ = ["ParallelConfig", "destroy_parallel", "init_parallel", "parallel_layout", "process_groups"]


@dataclass(kw_only=True)
class ParallelConfig:
    """How the policy is split across trainer ranks (Megatron-Core's model parallelism)."""

    tensor_parallel: int = 1  # ranks sharing each layer's weight matrices (TP)
    pipeline_parallel: int = 1  # consecutive groups of layers on different ranks (PP)
    virtual_pipeline: int | None = None  # model chunks per PP rank (interleaved 1F1B); None = off
    sequence_parallel: bool = False  # shard norm/dropout activations over TP (needs TP > 1 and TE)
    expert_parallel: int = 1  # ranks splitting each MoE layer's experts (EP); divides the DP size
    context_parallel: int = 1  # ranks splitting every sequence (CP, for long traces; packed layout)
    backend: str = "auto"  # torch.distributed backend: auto = nccl with CUDA, else gloo

    def __post_init__(self):
        check_range("tensor_parallel", self.tensor_parallel, low=1)
        check_range("pipeline_parallel", self.pipeline_parallel, low=1)
        check_range("expert_parallel", self.expert_parallel, low=1)
        check_range("context_parallel", self.context_parallel, low=1)
        if self.virtual_pipeline is not None:
            check_range("virtual_pipeline", self.virtual_pipeline, low=2)
            if self.pipeline_parallel < 2:
                raise ConfigFieldError(
                    "virtual_pipeline",
                    "interleaving needs pipeline_parallel >= 2"
                    f", got pipeline_parallel={self.pipeline_parallel}",
                )
        if self.sequence_parallel and self.tensor_parallel < 2:
            raise ConfigFieldError(
                "sequence_parallel", f"needs tensor_parallel >= 2, got tensor_parallel={self.tensor_parallel}"
            )
        check_choice("backend", self.backend, ("auto", "nccl", "gloo"))

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: ``tensor_parallel * pipeline_parallel``."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def replica_size(self) -> int:
        """Ranks that train one data-parallel replica: ``tensor_parallel * pipeline_parallel *
        context_parallel`` (the world size is a multiple of it)."""
        return self.model_parallel_size * self.context_parallel

    def resolved_backend(self) -> str:
        """``backend`` with ``auto`` resolved on this machine (nccl if CUDA is available)."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(cfg: ParallelConfig, *, seed: int, timeout_minutes: int = 30) -> None:
    """Set up torch.distributed and Megatron-Core's model-parallel state for ``cfg``; seed RNGs.

    - The default process group: reused if already initialised (tests, or a caller that set it
      up), else created from the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
      ``MASTER_PORT``), else a one-rank group in this process.
    - Without CUDA, :func:`~megatron_rl.training.cpu_compat.apply_cpu_compat` redirects
      Megatron's CUDA-only calls to the CPU. With CUDA, the device is ``LOCAL_RANK``.
    - ``world_size`` must be a multiple of ``tensor_parallel * pipeline_parallel``; the quotient
      is the data-parallel size, and a multiple of ``expert_parallel`` (the expert-parallel
      groups are cut from the data-parallel ranks).
    - Seeds: ``torch.manual_seed(seed)`` (the CPU generator; also the default state of the
      Megatron RNG tracker on CPU) and ``model_parallel_cuda_manual_seed(seed)``, which gives each
      TP rank its own model-parallel stream (seed + 2718 + tp_rank) for dropout in TP regions.

    Raises ValueError when the world size does not fit the layout or nccl is asked for without
    CUDA, and RuntimeError if Megatron's parallel state is already initialised.
    """
    from megatron.core import (  # lazy: megatron-core takes seconds to import; only this path needs it
        parallel_state,
        tensor_parallel,
    )

    backend = cfg.resolved_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend: nccl needs CUDA, and torch.cuda.is_available() is False; use backend 'gloo' or 'auto'"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        apply_cpu_compat()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if world % cfg.replica_size:
        raise ValueError(
            f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel x "
            f"context_parallel = {cfg.tensor_parallel} x {cfg.pipeline_parallel} x "
            f"{cfg.context_parallel} = {cfg.replica_size}"
        )
    if (world // cfg.model_parallel_size) % cfg.expert_parallel:
        raise ConfigFieldError(
            "expert_parallel",
            f"{cfg.expert_parallel} does not divide the data-parallel size "
            f"{world // cfg.model_parallel_size} (world size {world} / tensor_parallel x pipeline_parallel; "
            f"with context parallelism, the data x context parallel ranks)",
        )
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised; call destroy_parallel() first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline,
        expert_model_parallel_size=cfg.expert_parallel,
        context_parallel_size=cfg.context_parallel,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_group.rank())


def process_groups():
    """Megatron's ``ProcessGroupCollection`` of the groups made by :func:`init_parallel`.

    Pass it to ``GPTModel``, ``DistributedDataParallel`` and the schedules so that no code below
    reaches for global parallel state.
    """
    from megatron.core.process_groups_config import (
        ProcessGroupCollection,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_parallel(*, destroy_default_group: bool = False) -> None:
    """Tear down Megatron's model-parallel groups (and, if asked, the default process group).

    Safe to call when nothing was initialised. The default group is kept by default because a
    caller (torchrun script, test harness) may own it.
    """
    from megatron.core import (
        parallel_state,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    parallel_state.destroy_model_parallel()
    if destroy_default_group and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def parallel_layout(cfg: ParallelConfig, *, seed: int):
    """``init_parallel`` on entry, ``destroy_parallel`` (default group kept) on exit: one layout
    after another in the same processes, as tests and the conversion tools do."""
    init_parallel(cfg, seed=seed)
    try:
        yield
    finally:
        destroy_parallel()
