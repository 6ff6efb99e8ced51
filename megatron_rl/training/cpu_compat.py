"""Megatron-Core (0.16.x) on a machine without CUDA: the few redirections that make it run on CPU.

Megatron-Core's model, pipeline schedules, DDP and optimizers are device-agnostic PyTorch except
for a handful of places that name CUDA outright. On a CPU-only build of torch each of those raises
("Torch not compiled with CUDA enabled"), so redirecting them to the CPU changes nothing that could
have worked; it only turns a certain failure into the CPU behaviour. The redirections are:

1. ``torch`` as seen by a listed set of Megatron modules (and only by them) is replaced with a thin
   stand-in (:class:`_CpuTorch`) that forwards every attribute to the real ``torch`` except that
   ``torch.cuda.current_device()`` answers ``cpu``, ``torch.cuda.synchronize()`` is a no-op, and
   the tensor factories (``zeros``, ``ones``, ``empty``, ``tensor``, ``full``, ``arange``) map a CUDA
   ``device=`` argument to the CPU. This covers the literal ``device="cuda"`` token counters of the
   pipeline schedules, the causal masks, the optimizer's ``found_inf``/``_scale`` tensors, the
   DDP/distributed-optimizer buffers and the tensor-parallel gather buffers. Other libraries,
   and other Megatron modules, still see the real ``torch``.
2. The RNG tracker of ``megatron.core.tensor_parallel.random`` forks the CPU generator instead of
   the CUDA one (:class:`CpuRNGStatesTracker`), and the module's ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` (used by activation checkpointing) read and write the CPU state.
   ``model_parallel_cuda_manual_seed`` then works unchanged: its ``torch.cuda.manual_seed`` is
   queued lazily by torch and never runs without CUDA, so the caller seeds the CPU generator
   (``init_parallel`` does), as Megatron's own training loop does with ``torch.manual_seed``.
3. Four functions that inspect ``Tensor.type() == 'torch.cuda.FloatTensor'`` or call
   ``Tensor.cuda()`` run, *for their own duration only*, with CPU tensors reporting CUDA type names
   and ``.cuda()`` returning the tensor itself (:func:`_cpu_tensors_pass_as_cuda`).

Nothing here edits a file. :func:`apply_cpu_compat` is a no-op when CUDA is available and cheap on
every call after the first. Known gaps on CPU: resuming the *distributed optimizer* from a
checkpoint (megatron-core 0.16.1; the plain optimizer resumes), asynchronous checkpoint saving
(``strategies/async_utils.py`` is not redirected), CUDA graphs, and anything that needs Transformer
Engine or Apex kernels (sequence parallelism with the local layer spec, fused kernels, fp8).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.types import Device

__all__ = ["PATCHED_MODULES", "CpuRNGStatesTracker", "apply_cpu_compat", "cpu_compat_applied"]

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_lock = threading.Lock()
_applied = False

# Megatron modules whose ``torch`` global is replaced with the CPU stand-in, each with the reason.
PATCHED_MODULES: dict[str, str] = {
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens = torch.zeros(..., device='cuda') in every schedule",
    "megatron.core.pipeline_parallel.p2p_communication": "shape/receive buffers on torch.cuda.current_device(); torch.cuda.synchronize() after p2p",
    "megatron.core.tensor_parallel.layers": "weights (without CPU init), sequence-parallel and grad-accumulation buffers on current_device",
    "megatron.core.tensor_parallel.mappings": "all-gather / reduce-scatter output buffers on current_device",
    "megatron.core.tensor_parallel.utils": "gather_split_1d_tensor buffer on current_device",
    "megatron.core.transformer.utils": "causal and sliding-window attention masks built with device='cuda'",
    "megatron.core.transformer.dot_product_attention": "softmax_offset parameter on current_device",
    "megatron.core.transformer.attention": "inference KV cache allocated on current_device",
    "megatron.core.transformer.transformer_layer": "static inputs / attention mask on current_device",
    "megatron.core.transformer.moe.router": "gating moves the router weight to current_device on every forward",
    "megatron.core.models.gpt.gpt_model": "inference sequence_len_offset on current_device",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "get_emb moves inv_freq to current_device on every first forward",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YaRN (DeepSeek's MLA): moves its inverse frequencies to current_device at the first forward",
    "megatron.core.distributed.param_and_grad_buffer": "contiguous param/grad buffers on current_device",
    "megatron.core.distributed.distributed_data_parallel": "torch.cuda.synchronize() around buffer offload / reload",
    "megatron.core.optimizer.optimizer": "found_inf / _scale / _dummy_overflow_buf tensors with device='cuda'",
    "megatron.core.optimizer.distrib_optimizer": "gather/scatter buffers of optimizer state on current_device",
    "megatron.core.optimizer.clip_grads": "grad-norm and count-zeros tensors with device='cuda'",
    "megatron.core.utils": "GlobalMemoryBuffer on current_device; local l2-norm result with device='cuda'",
    "megatron.core.rerun_state_machine": "result validation tensors with device='cuda' / current_device",
    "megatron.core.parallel_state": "torch.cuda.synchronize() in update_pg_timeout",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "metadata-reuse verification tensor with device='cuda'",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize() after staging tensors for the checkpoint writer",
}

# (module, qualified attribute) of functions that must see CPU tensors pass for CUDA tensors.
_CUDA_TYPE_SCOPES: tuple[tuple[str, str, str], ...] = (
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.__init__",
        "groups params by model_param.type() == 'torch.cuda.FloatTensor' / HalfTensor, else TypeError",
    ),
    (
        "megatron.core.optimizer.optimizer",
        "Float16OptimizerWithFloat16Params.__init__",
        "sorts params by param.type() in torch.cuda.{Half,BFloat16,Float}Tensor, else TypeError",
    ),
    (
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        "asserts param.grad.type() == 'torch.cuda.FloatTensor'",
    ),
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
        "tied embeddings with PP > 1: weight.data = weight.data.cuda() before the all-reduce",
    ),
)


def cpu_compat_applied() -> bool:
    """Whether :func:`apply_cpu_compat` has patched Megatron in this process."""
    return _applied


def apply_cpu_compat() -> bool:
    """Redirect Megatron-Core's CUDA-only calls to the CPU when CUDA is absent.

    Returns True when the patches are in place (now or from an earlier call), False when CUDA is
    available and nothing was done. Idempotent and thread-safe; later calls return at once.
    """
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        stand_in = _CpuTorch()
        for name in PATCHED_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError as err:
                raise RuntimeError(
                    f"cpu_compat: cannot import {name} ({err}); written for "
                    "megatron-core 0.16.x, review PATCHED_MODULES"
                ) from err
            if isinstance(getattr(module, "torch", None), _CpuTorch):
                continue  # patched by an earlier call that failed further on
            if getattr(module, "torch", None) is not torch:
                raise RuntimeError(
                    f"cpu_compat: {name}.torch is not the torch module; "
                    "megatron-core changed, review PATCHED_MODULES"
                )
            module.torch = stand_in  # type: ignore[attr-defined]  # ModuleType declares no ``torch``; it has one (checked above)
        for module_name, qualname, _why in _CUDA_TYPE_SCOPES:
            _wrap_in_cuda_type_scope(module_name, qualname)
        _patch_rng()
        _applied = True
        log.info("cpu_compat: Megatron-Core redirected to CPU (%d modules)", len(PATCHED_MODULES))
    return True


# -- 1. the ``torch`` stand-in ------------------------------------------------------------------


def _cpu_if_cuda(device: Device) -> Device:
    """``device`` unchanged unless it names CUDA ('cuda', 'cuda:0', torch.device('cuda'), an int)."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU  # a bare int is a CUDA ordinal to torch
    if torch.device(device).type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # Any: the arguments of torch's own (overloaded) factory, forwarded unchanged but ``device``.
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        # pin_memory needs an accelerator; Megatron pins only staging tensors bound for the GPU.
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


class _CpuCuda:
    """``torch.cuda`` as seen by a patched module: the current device is the CPU."""

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Device = None) -> None:
        """CPU ops are synchronous; Megatron calls this after p2p and before freeing buffers."""

    def __getattr__(self, name: str) -> Any:  # Any: whatever torch.cuda holds under that name
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` as seen by a patched module: everything forwarded except CUDA device choices.

    Attribute reads not defined here go to the real ``torch`` module on every access (no caching),
    so later changes to ``torch`` stay visible.
    """

    cuda = _CpuCuda()
    zeros = staticmethod(_cpu_factory(torch.zeros))
    ones = staticmethod(_cpu_factory(torch.ones))
    empty = staticmethod(_cpu_factory(torch.empty))
    tensor = staticmethod(_cpu_factory(torch.tensor))
    full = staticmethod(_cpu_factory(torch.full))
    arange = staticmethod(_cpu_factory(torch.arange))

    def __getattr__(self, name: str) -> Any:  # Any: whatever torch holds under that name
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch, with CUDA devices mapped to CPU by megatron_rl.training.cpu_compat>"


# -- 3. CUDA type names, inside a few functions only ---------------------------------------------

_scope_depth = 0


@contextlib.contextmanager
def _cpu_tensors_pass_as_cuda() -> Iterator[None]:
    """While inside: ``t.type()`` of a CPU tensor says ``torch.cuda.*`` and ``t.cuda()`` is ``t``.

    Re-entrant (nested scopes restore once, at the outermost exit). Not meant for threads: the
    wrapped functions are constructors and a grad-clip step, called from the training thread.
    """
    global _scope_depth
    if _scope_depth > 0:
        _scope_depth += 1
        try:
            yield
        finally:
            _scope_depth -= 1
        return
    # Both methods are inherited from torch._C.TensorBase; remember whether Tensor had its own.
    own = {name: torch.Tensor.__dict__.get(name) for name in ("type", "cuda")}
    original_type = torch.Tensor.type

    def type_(
        self: torch.Tensor, dtype: torch.dtype | str | None = None, non_blocking: bool = False, **kw: object
    ) -> str | torch.Tensor:
        if dtype is None and not kw and self.device.type == "cpu":
            return original_type(self).replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kw)

    def cuda_(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self

    # Patched for this scope only (restored below), with plain functions in place of the stubs' overloads.
    torch.Tensor.type, torch.Tensor.cuda = type_, cuda_  # type: ignore[method-assign, assignment]  # see above
    _scope_depth = 1
    try:
        yield
    finally:
        _scope_depth = 0
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def _wrap_in_cuda_type_scope(module_name: str, qualname: str) -> None:
    owner: Any = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, attr)
    if getattr(fn, "_cpu_compat_scoped", False):
        return

    # Any: ``fn`` is a megatron-core function or method, and megatron-core ships no types.
    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_pass_as_cuda():
            return fn(*args, **kwargs)

    scoped._cpu_compat_scoped = True  # type: ignore[attr-defined]  # a marker on the function object
    setattr(owner, attr, scoped)
    if path:
        return  # a method: every importer shares the class object
    # A function is also bound by name in the modules that imported it (optimizer.py does
    # ``from .clip_grads import clip_grad_by_total_norm_fp32``): rebind those references too.
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, attr, None) is fn:
            setattr(module, attr, scoped)


# -- 2. the RNG tracker ---------------------------------------------------------------------------


def _get_cpu_rng_state(device: Device = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Drop-in for ``random._get_cuda_rng_state``: the CPU generator's state (a fresh tensor)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Device = -1, graph_safe: bool = False) -> None:
    """Drop-in for ``random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _make_tracker_class() -> type:
    from megatron.core.tensor_parallel import (
        random as mrandom,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker over the CPU generator: named states forked in and out of it.

        Differs from the CUDA tracker in two ways only: states are CPU generator states, and
        ``fork`` does not warn that "the CPU RNG state changed" (here that is the point).
        """

        _current_state_name: str  # set by the base class; declared for the type checker

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the "
                        f"same as the desired state name {name}."
                    )
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


CpuRNGStatesTracker: type | None = None  # set by apply_cpu_compat (needs megatron imported)


def _patch_rng() -> None:
    global CpuRNGStatesTracker
    from megatron.core.tensor_parallel import (
        random as mrandom,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    CpuRNGStatesTracker = _make_tracker_class()
    # initialize_rng_tracker instantiates the module-level name; isinstance checks against it
    # (get_all_rng_states) keep working because the CPU tracker subclasses the original.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # Activation checkpointing saves/restores "the CUDA state" through these two functions.
    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    # A tracker created before the patch can hold no state on CPU (its add() would have raised),
    # so replacing it loses nothing.
    if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED and not isinstance(
        mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker
    ):
        mrandom.initialize_rng_tracker(force_reset=True)
