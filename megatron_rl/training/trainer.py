"""The policy trainer: a Megatron-Core GPT model under DDP, Megatron's optimizer and LR schedule,
and the GRPO / SFT / log-prob steps run through Megatron's pipeline schedule.

    trainer = PolicyTrainer(hf_config, TrainerConfig(...), GRPOConfig(), BatchingConfig())
    metrics = trainer.rl_step(build_train_batch(groups, grpo_cfg))   # one optimizer step
    metrics = trainer.sft_step(build_sft_batch(pairs))                # one optimizer step
    logps = trainer.compute_logprobs(batch)                           # [C_i] per sequence

Launch: every trainer rank constructs the trainer and calls the same methods with the same global
minibatch (``torchrun --nproc-per-node N python -m megatron_rl.<verb> ...`` on GPUs; on CPU, gloo
ranks started by the caller). If Megatron's parallel state is not initialised yet the trainer calls
:func:`~megatron_rl.training.parallel.init_parallel` itself (seeded with ``TrainerConfig.seed``) and
:meth:`PolicyTrainer.close` tears it down again; if the caller initialised it, the layout must
match ``TrainerConfig.parallel`` and the caller owns it.

Data flow of a step: the data-parallel assignment (``batching/dp.py``, seeded with
``batching.seed + step`` so every rank derives the same split) gives this rank's replica its
sequences; they are collated into microbatches under ``batching.token_budget``; Megatron's schedule
runs the forward steps of ``training/steps.py`` (gradient scaling derived there); the optimizer
steps once; the metric sums are reduced over the world once, from the one rank per data-parallel
replica that holds them (last pipeline stage, TP rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.algorithms.loss import finalize_loss_metrics, reduce_loss_metrics
from megatron_rl.batching.collate import (
    Microbatch,
    build_microbatches,
    filler_microbatch,
    pad_microbatch,
    split_for_context_parallel,
)
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.batching.dp import assign_data_parallel
from megatron_rl.config import ConfigFieldError
from megatron_rl.errors import InputError
from megatron_rl.hf.arch import (
    CARRIED_PREFIXES,
    language_model_config,
    load_hf_config,
    moe_settings,
    padded_vocab_size,
    routed_shape,
)
from megatron_rl.hf.files import HFWeights, carried_tensors, nonfinite_problem, write_hf_folder
from megatron_rl.hf.layout import HFConverter
from megatron_rl.training.checkpoint import NonFiniteError, load_checkpoint, save_checkpoint
from megatron_rl.training.chunks import iter_model_hf, load_hf_into_chunk
from megatron_rl.training.config import TrainerConfig
from megatron_rl.training.model import build_gpt_model, transformer_config_from_hf
from megatron_rl.training.parallel import destroy_parallel, init_parallel, process_groups
from megatron_rl.training.steps import (
    LossMode,
    StepContext,
    finalize_grads_summed,
    finalize_sft_metrics,
    make_forward_step,
    metric_keys,
)
from megatron_rl.types import TrainBatch

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from transformers import PretrainedConfig

    from megatron_rl.fileio import JsonValue
    from megatron_rl.hf.arch import HFConfigLike

__all__ = ["PolicyTrainer"]

log = logging.getLogger(__name__)

# Per-replica collation figures reduced with the loss metrics (names kept apart from theirs).
_STAT_KEYS = ("microbatches", "batch_tokens", "slot_tokens")


def _ensure_parallel(cfg: TrainerConfig) -> bool:
    """Initialise Megatron's parallel state for ``cfg.parallel`` unless done; True if done here."""
    from megatron.core import (
        parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    p = cfg.parallel
    if not ps.model_parallel_is_initialized():
        init_parallel(p, seed=cfg.seed)
        return True
    have = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    want = (p.tensor_parallel, p.pipeline_parallel, p.virtual_pipeline)
    if have != want:
        raise ValueError(
            f"parallel: Megatron is initialised with (tensor, pipeline, virtual) = "
            f"{have}, the trainer config asks for {want}"
        )
    return False


class PolicyTrainer:
    """Megatron-Core policy with DDP, optimizer and schedule; one optimizer step per batch.

    Attributes a checkpoint needs: ``model`` (list of DDP-wrapped chunks, one per virtual stage),
    ``optimizer`` (Megatron optimizer), ``scheduler`` (``OptimizerParamScheduler``) and ``step``
    (optimizer steps taken; stored in the scheduler, so restoring the scheduler restores it).
    """

    def __init__(
        self,
        hf_config: HFConfigLike,
        cfg: TrainerConfig,
        grpo: GRPOConfig,
        batching: BatchingConfig,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size``: the tokenizer's vocabulary (default: the HF config's); the model pads it
        (``padded_vocab_size``) and the padded ids are masked out of every log-softmax."""
        if grpo.kl_coef:
            raise ValueError(
                "kl_coef: a KL term needs a reference model, which the trainer does not build; use kl_coef 0"
            )
        self.cfg, self.grpo, self.batching = cfg, grpo, batching
        hf = load_hf_config(hf_config)
        p = cfg.parallel
        if p.tensor_parallel > 1 and not p.sequence_parallel and moe_settings(hf) is not None:
            # Megatron's MoE layer refuses it at the first training step; say so before building.
            raise ValueError(
                "trainer.parallel.tensor_parallel: Megatron trains an MoE model at "
                f"tensor_parallel={p.tensor_parallel} only with sequence_parallel: true, which needs "
                "Transformer Engine; without it train the MoE at tensor_parallel 1 (conversion and "
                "generation work at any layout)"
            )
        if grpo.routing_replay == "rollout":
            routed_shape(hf)  # ValueError naming algorithm.routing_replay for a model without experts
            if cfg.recompute:
                raise ValueError(
                    "algorithm.routing_replay: rollout with trainer.recompute: true is not supported "
                    "(the recomputed forward would route again); turn one of them off"
                )
        self._owns_parallel = _ensure_parallel(cfg)
        self.pgs = process_groups()
        self.hf_config = hf  # the architecture (weight names and shapes of hf_tensors)
        self.vocab_size = int(vocab_size or language_model_config(hf).vocab_size)
        self.params_dtype = cfg.params_dtype()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        if cfg.cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)  # process-wide: this rank's torch threads
        p = cfg.parallel
        self._uniform_shapes = bool(p.virtual_pipeline) and p.pipeline_parallel == 2
        self.model = self._build_model(hf)
        self.optimizer, self.scheduler = self._build_optimizer()
        self.model[0].config.grad_scale_func = self.optimizer.scale_loss
        # This rank holds its replica's loss metrics: last pipeline stage, first TP rank.
        self._reports = self.pgs.pp.rank() == self.pgs.pp.size() - 1 and self.pgs.tp.rank() == 0
        self.nonfinite_steps = 0  # steps skipped for a NaN/inf loss or grad norm, in all
        self._nonfinite_in_a_row = 0  # ... since the last step taken

    # -- construction -----------------------------------------------------------------------------

    def _build_model(self, hf: PretrainedConfig) -> list[DistributedDataParallel]:
        from megatron.core.distributed import (  # lazy: megatron-core takes seconds to import; only this path needs it
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.transformer.module import (
            Float16Module,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        p = self.cfg.parallel
        overrides: dict[str, object] = dict(
            calculate_per_token_loss=True,  # loss used as returned; DDP sums (see steps.py)
        )
        if self.cfg.recompute:
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if self.grpo.routing_replay == "rollout":  # checked in __init__
            overrides["moe_enable_routing_replay"] = True
        config = transformer_config_from_hf(hf, p, params_dtype=self.params_dtype, **overrides)
        if self._uniform_shapes:
            # PP = 2 with interleaving: both p2p directions go to the same peer. Megatron's batched
            # p2p (and its shape exchange, always batched) then pairs the forward message of one
            # rank with the backward message of the other in the 1F1B steady state -- measured
            # here: wrong loss and gradients over gloo. Megatron's unbatched path sends the two
            # directions on different communicators; it needs one fixed shape per step, so the
            # microbatches of a step are padded to one shape (_local_microbatches).
            config.batch_p2p_comm = False
        else:
            # Microbatch shapes differ, so the pipeline's p2p exchanges shapes first. Set after
            # construction: TransformerConfig refuses it with its default MoE token dispatcher,
            # a check that does not concern a dense model.
            config.variable_seq_lengths = True
        stages = range(p.virtual_pipeline) if p.virtual_pipeline else [None]
        chunks = [
            build_gpt_model(
                hf, p, vocab_size=self.vocab_size, params_dtype=self.params_dtype, vp_stage=s, config=config
            )
            for s in stages
        ]
        if config.bf16:
            chunks = [Float16Module(config, c) for c in chunks]
        if torch.cuda.is_available():
            chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            average_in_collective=False,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer(),
        )
        # Megatron buckets only the first chunk's grads under interleaving (get_model does so too).
        model = [
            DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0, pg_collection=self.pgs)
            for i, c in enumerate(chunks)
        ]
        config.finalize_model_grads_func = finalize_grads_summed
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        return model

    def _build_optimizer(self) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
        from megatron.core.optimizer import (  # lazy: megatron-core takes seconds to import; only this path needs it
            OptimizerConfig,
            get_megatron_optimizer,
        )
        from megatron.core.optimizer_param_scheduler import (
            OptimizerParamScheduler,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        o = self.cfg.optim
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                bf16=self.params_dtype == torch.bfloat16,
                params_dtype=self.params_dtype,
                use_distributed_optimizer=self.cfg.use_distributed_optimizer(),
            ),
            self.model,
        )
        # Megatron needs decay_steps > max(0, warmup_steps) even for the constant style, where it
        # is never read. The scheduler advances *before* each optimizer step (see _train_step), so
        # step k (1-based) runs at lr * min(1, k / warmup_steps) and the first step is not lr 0.
        decay = o.decay_steps if o.decay_style != "constant" else o.warmup_steps + 1
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=decay,
            lr_decay_style=o.decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        return optimizer, scheduler

    # -- state ------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken (the scheduler's step count)."""
        return int(self.scheduler.num_steps)

    @step.setter
    def step(self, value: int) -> None:
        self.scheduler.num_steps = int(value)
        self.scheduler.step(0)  # re-apply the learning rate of that step

    @property
    def chunks(self) -> list[GPTModel]:
        """The bare ``GPTModel`` chunks (DDP and Float16Module unwrapped), for weight export."""
        from megatron.core.utils import (
            unwrap_model,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        return unwrap_model(self.model)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def num_parameters(self) -> int:
        """Parameters of the whole model, counted once (collective over the model-parallel group):
        TP shards add up, TP-replicated weights count on TP rank 0, the last stage's copy of a
        tied embedding (``param.shared``) is skipped."""
        tp_rank0 = self.pgs.tp.rank() == 0
        count = sum(
            p.numel()
            for chunk in self.model
            for p in chunk.parameters()
            if not getattr(p, "shared", False) and (getattr(p, "tensor_model_parallel", False) or tp_rank0)
        )
        total = torch.tensor(count, dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.pgs.mp)
        return int(total)

    def save_checkpoint(
        self,
        root: str | os.PathLike[str],
        *,
        extra: dict[str, object] | None = None,
        keep_last: int | None = 3,
        carried_from: str | os.PathLike[str] | None = None,
    ) -> Path:
        """Atomic checkpoint of model, optimizer, scheduler (the step) and RNG under ``root``
        (collective; see :mod:`megatron_rl.training.checkpoint`). Returns its folder. A
        vision-language model's carried tensors (vision tower, projector) are kept in it too,
        read from ``carried_from`` (the HF folder the run started from)."""
        prefixes = CARRIED_PREFIXES.get(self.hf_config.model_type, ())
        carried = carried_tensors(carried_from, prefixes) if carried_from is not None and prefixes else None

        return save_checkpoint(
            root,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            extra=extra,
            keep_last=keep_last,
            seed=self.cfg.seed,
            carried=carried,
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, JsonValue]:
        """Resume from a checkpoint folder, or the newest intact one under a root (a corrupt one
        is logged and passed over for the one before it), written at any TP/PP; returns its
        ``extra``. The step comes back with the scheduler. Raises CheckpointCorruptError when the
        folder given, or every checkpoint under the root, fails its manifest."""

        _, extra = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        return extra

    def load_hf(self, folder: str | os.PathLike[str]) -> None:
        """Copy an HF folder's weights into this rank's shards of every chunk (any TP/PP), and
        refresh the optimizer's main copies (collective only in that every rank reads)."""
        weights = HFWeights(folder)
        try:
            for chunk in self.chunks:
                load_hf_into_chunk(
                    chunk,
                    self.hf_converter(folder),
                    weights,
                    tp_rank=self.pgs.tp.rank(),
                    tp_size=self.pgs.tp.size(),
                )
        finally:
            weights.close()
        # A policy holding NaN or Inf could never generate or train: refused here, naming the
        # tensor, on every rank (the rank that holds it says which), before any server starts.
        mine = next(
            (
                problem
                for chunk in self.chunks
                for name, param in chunk.named_parameters()
                if (problem := nonfinite_problem(name, param.detach(), str(folder))) is not None
            ),
            None,
        )
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        problem = next((p for p in found if p), None)
        if problem is not None:
            raise InputError(f"model.hf: {problem}")
        self.optimizer.reload_model_params()

    def hf_converter(self, hf_config: HFConfigLike) -> HFConverter:
        """The HF <-> Megatron name map for this model (its padded vocabulary and TP)."""
        tp = self.pgs.tp.size()
        return HFConverter.for_config(
            hf_config, tensor_parallel=tp, padded_vocab=padded_vocab_size(self.vocab_size, tp)
        )

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF-named tensor of the current policy, streamed on global rank 0 in model order;
        collective over the model-parallel ranks of the first data-parallel replica, which must all
        iterate it (other ranks get nothing). What the weight broadcast sends."""
        return iter_model_hf(self.chunks, self.hf_converter(self.hf_config))

    def export_hf(
        self,
        out: str | os.PathLike[str],
        *,
        like: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        max_shard: str = "2GB",
    ) -> Path | None:
        """Write the current weights as an HF folder ``out`` (config and tokenizer files from
        the HF folder ``like``), atomically; collective over the model-parallel ranks of the
        first data-parallel replica (call it on every rank). Returns ``out`` on rank 0.

        A vision-language model's carried tensors (vision tower, projector) are written after the
        language model's, bit for bit (never cast to ``dtype``), from ``like``."""
        if self.pgs.expt_dp.rank() != 0:  # = dp rank without EP; EP peers join the expert gathers
            return None
        converter = self.hf_converter(like)
        tensors = iter_model_hf(self.chunks, converter)
        if dist.get_rank() != 0:
            for _ in tensors:  # take part in the gathers
                pass
            return None
        return write_hf_folder(
            out,
            load_hf_config(like).to_dict(),
            tensors,
            side_files_from=like,
            max_shard=max_shard,
            dtype=dtype,
            carried=carried_tensors(like, converter.carried),
        )

    def close(self) -> None:
        """Tear down the parallel state if this trainer set it up."""
        if self._owns_parallel:
            destroy_parallel()
            self._owns_parallel = False

    # -- steps ------------------------------------------------------------------------------------

    def rl_step(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO optimizer step on the global minibatch ``batch`` (identical on every rank).

        Returns (same on every rank): ``loss`` (sum_t w_t loss_t over the minibatch),
        ``grad_norm`` (before clipping), ``lr``, the finalized loss metrics (``tokens``,
        ``ratio_mean``/``ratio_max``, ``clip_low_frac``/``clip_high_frac``, ``approx_kl_mean``,
        ``entropy_mean``, ``advantage_mean``/``advantage_std``, ``loss_unweighted_mean``),
        ``microbatches`` (over all replicas), ``padding_fraction``, ``step_time_s``,
        ``tokens_per_s`` (prompt + completion tokens of the minibatch per second), ``step``,
        ``update_successful`` (0 only when Megatron skips an update on overflow: fp16 loss
        scaling, not used here), ``skipped`` (0) and ``nonfinite_steps`` (steps skipped so far for
        a non-finite loss or gradient norm). An empty batch (every group filtered) takes no step
        and returns ``{"skipped": 1.0, "lr": ..., "step": ...}``.

        A step whose loss or gradient norm is NaN or inf, on any rank, is skipped on every rank:
        weights, optimizer state and LR schedule stay as they were and the gradients are zeroed.
        Its metrics are the finite ones of the step with ``skipped`` 1, ``nonfinite_loss`` and
        ``nonfinite_grad_norm`` (1 for the value that was not finite), ``nonfinite_steps`` and
        ``nonfinite_in_a_row``. The ``TrainerConfig.max_nonfinite_steps``-th skip in a row raises
        :class:`~megatron_rl.training.checkpoint.NonFiniteError` instead (state as before it).
        """
        return self._train_step(batch, "grpo")

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One SFT optimizer step (batch from ``batching.sft.build_sft_batch``); returns ``loss``
        (mean answer-token NLL), ``nll_mean``, ``entropy_mean``, ``tokens`` and the step figures
        of :meth:`rl_step`."""
        return self._train_step(batch, "sft")

    def _train_step(self, batch: TrainBatch, mode: LossMode) -> dict[str, float]:
        if len(batch) == 0:
            return {"skipped": 1.0, "lr": self.lr, "step": float(self.step)}
        start = time.perf_counter()
        metrics = self.forward_backward(batch, mode)
        # Decided before the scheduler or the optimizer moves, so that a skipped step leaves both
        # exactly as they were.
        bad_loss, bad_norm, norm = self._nonfinite(metrics["loss"])
        if bad_loss or bad_norm:
            return self._skip(metrics, bad_loss, bad_norm, norm, time.perf_counter() - start)
        self._nonfinite_in_a_row = 0
        self.scheduler.step(1)  # the lr of this step (warm-up counts from step 1)
        ok = self._clip_and_step(norm)
        elapsed = time.perf_counter() - start
        metrics.update(
            grad_norm=norm,
            lr=self.lr,
            update_successful=float(ok),
            step_time_s=elapsed,
            tokens_per_s=sum(batch.lengths) / elapsed,
            step=float(self.step),
            skipped=0.0,
            nonfinite_steps=float(self.nonfinite_steps),
        )
        return metrics

    def _nonfinite(self, loss: float) -> tuple[bool, bool, float]:
        """Whether the minibatch loss and the gradient norm are non-finite on any rank (agreed by
        one MAX all-reduce over the world, so that no rank steps while another skips), and the
        gradient norm (before clipping), computed here once per step: :meth:`_clip_and_step`
        clips with it. ``prepare_grads`` points the optimizer's main params at the reduced grads
        (no grad scaler: bf16 and fp32 only, so it never reports an overflow)."""
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        flags = torch.tensor(
            [not math.isfinite(loss), not math.isfinite(norm)], dtype=torch.float32, device=self.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_loss, bad_norm = (bool(f) for f in flags.tolist())
        return bad_loss, bad_norm, norm

    def _clip_and_step(self, norm: float) -> bool:
        """Clip the prepared main grads to ``clip_grad`` by the total ``norm`` of
        :meth:`_nonfinite` and step: what ``optimizer.step()`` does after its own
        ``prepare_grads`` and norm, without computing either again. Returns whether the update
        was applied (Megatron's ``step_with_ready_grads``)."""
        from megatron.core.optimizer import (
            clip_grads,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        # A ChainedOptimizer clips each of its optimizers by the norm over all of them.
        for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
            if params and opt.config.clip_grad > 0.0:
                # Looked up at call time: cpu_compat may have wrapped the module's function.
                clip_grads.clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=opt.config.clip_grad,
                    total_norm=norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        return bool(self.optimizer.step_with_ready_grads())

    def _skip(
        self, metrics: dict[str, float], bad_loss: bool, bad_norm: bool, norm: float, elapsed: float
    ) -> dict[str, float]:
        """Drop this step's gradients and count it; raise NonFiniteError at the limit."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.nonfinite_steps += 1
        self._nonfinite_in_a_row += 1
        what = " and ".join(
            f"{name} is {value}"
            for name, value, bad in (("loss", metrics["loss"], bad_loss), ("grad norm", norm, bad_norm))
            if bad
        )
        limit = self.cfg.max_nonfinite_steps
        if self._nonfinite_in_a_row >= limit:
            raise NonFiniteError(
                f"step {self.step + 1}: {what}; that is {self._nonfinite_in_a_row} steps in a row with "
                f"a non-finite loss or gradient norm (trainer.max_nonfinite_steps = {limit}). "
                f"Nothing was updated: the weights are those after step {self.step}"
            )
        log.warning(
            "trainer: step %d: %s; skipped (%d in a row, %d allowed)",
            self.step + 1,
            what,
            self._nonfinite_in_a_row,
            limit - 1,
        )
        out = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if not bad_norm:  # then finite on every rank, and the same: the grads are DP-reduced
            out["grad_norm"] = norm
        out.update(
            lr=self.lr,
            update_successful=0.0,
            step_time_s=elapsed,
            step=float(self.step),
            skipped=1.0,
            nonfinite_loss=float(bad_loss),
            nonfinite_grad_norm=float(bad_norm),
            nonfinite_steps=float(self.nonfinite_steps),
            nonfinite_in_a_row=float(self._nonfinite_in_a_row),
        )
        return out

    def forward_backward(
        self, batch: TrainBatch, mode: LossMode = "grpo", *, batching: BatchingConfig | None = None
    ) -> dict[str, float]:
        """Gradients of the minibatch loss into the DDP grad buffers (``param.main_grad``,
        reduced over DP), without an optimizer step. ``batching`` overrides the trainer's
        collation settings for this call (the gradient does not depend on them)."""
        if mode not in ("grpo", "sft"):
            raise ValueError(f"mode must be 'grpo' or 'sft', got {mode!r}")
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs, stats = self._local_microbatches(batch, batching or self.batching)
        parts = self._run(mbs, mode, forward_only=False)
        summed = self._reduce_metrics(parts, metric_keys(mode, self.grpo.objective), stats)
        out = {"loss": float(summed["loss"])}
        out.update(finalize_loss_metrics(summed) if mode == "grpo" else finalize_sft_metrics(summed))
        out["microbatches"] = float(summed["microbatches"])
        slots = float(summed["slot_tokens"])
        out["padding_fraction"] = 1.0 - float(summed["batch_tokens"]) / slots if slots else 0.0
        return out

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float | None = None, batching: BatchingConfig | None = None
    ) -> list[torch.Tensor]:
        """Every sequence's completion-token log-probs ``[C_i]`` (fp32, CPU), on every rank.

        Forward only, through the same path as the loss (padded vocabulary masked, vocab-parallel
        log-softmax). ``temperature`` defaults to ``GRPOConfig.temperature``, the generator's.
        """
        n = len(batch)
        if n == 0:
            return []
        mbs, _ = self._local_microbatches(batch, batching or self.batching)
        parts = self._run(mbs, "logprobs", forward_only=True, temperature=temperature)
        offsets = [0]
        for s in batch.sequences:
            offsets.append(offsets[-1] + s.completion_length)
        # Each position is written by exactly one rank (its replica's reporting rank); the others
        # add zeros, so one SUM all-reduce over the world assembles the batch exactly.
        flat = torch.zeros(offsets[-1], dtype=torch.float32, device=self.device)
        if self._reports:
            for part in parts:
                for i, values in zip(part["seq_index"], part["logprobs"]):
                    if i >= 0:
                        flat[offsets[i] : offsets[i + 1]] = values
        dist.all_reduce(flat)
        flat = flat.cpu()
        return [flat[offsets[i] : offsets[i + 1]].clone() for i in range(n)]

    # -- internals ----------------------------------------------------------------------------------

    def _local_microbatches(
        self, batch: TrainBatch, b: BatchingConfig
    ) -> tuple[list[Microbatch], dict[str, float]]:
        """This replica's microbatches (``seq_index`` = indices into ``batch``) and its
        collation figures. Pads with :func:`~megatron_rl.batching.collate.filler_microbatch` to
        at least one microbatch, and under interleaving to a multiple of the pipeline size
        (Megatron's interleaved schedule runs microbatches in groups of ``pipeline_parallel``)."""
        ids = torch.cat([s.tokens for s in batch.sequences] or [torch.zeros(1, dtype=torch.long)])
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}), got min "
                f"{int(ids.min())}, max {int(ids.max())}"
            )
        dp = self.pgs.dp.size()
        assignment = assign_data_parallel(batch.lengths, dp, mode=b.dp_assignment, seed=b.seed + self.step)
        mine = assignment[self.pgs.dp.rank()]
        # Context parallelism: microbatches are planned whole (a rank holds 1/cp of each, so the
        # per-rank budget times cp), every sequence in a segment of a multiple of 2 cp tokens,
        # then split; the microbatches of a replica's cp ranks are the same ones.
        cp = self.pgs.cp.size()
        seg = 2 * cp if cp > 1 else 1
        if cp > 1 and b.layout != "packed":
            raise ConfigFieldError(
                "layout", f"context parallelism ({cp} ranks) splits packed rows only, got layout {b.layout!r}"
            )
        mbs = []
        if mine:
            mbs = build_microbatches(
                batch.subset(mine),
                b.token_budget * cp,
                layout=b.layout,
                strategy=b.strategy,
                pad_to_multiple=b.pad_to_multiple,
                segment_multiple=seg,
            )
        for mb in mbs:
            mb.seq_index = [mine[j] for j in mb.seq_index]
        stats = {
            "microbatches": float(len(mbs)),
            "batch_tokens": float(sum(mb.num_tokens for mb in mbs)),
            "slot_tokens": float(sum(mb.tokens.numel() for mb in mbs)),
        }
        multiple = self.pgs.pp.size() if self.cfg.parallel.virtual_pipeline else 1
        while not mbs or len(mbs) % multiple:
            mbs.append(filler_microbatch(b.layout, b.pad_to_multiple, seg))
        if self._uniform_shapes:
            rows = max(mb.tokens.shape[0] for mb in mbs)
            width = max(mb.tokens.shape[1] for mb in mbs)
            mbs = [pad_microbatch(mb, rows, width) for mb in mbs]
        if cp > 1:
            mbs = [split_for_context_parallel(mb, cp, self.pgs.cp.rank()) for mb in mbs]
        return mbs, stats

    def _context(self, temperature: float | None = None) -> StepContext:
        g = self.grpo
        return StepContext(
            tp_group=self.pgs.tp if self.pgs.tp.size() > 1 else None,
            vocab_size=self.vocab_size,
            device=self.device,
            temperature=g.temperature if temperature is None else temperature,
            chunk_size=g.logprob_chunk_size or None,
            eps_low=g.eps_low,
            eps_high=g.eps_high,
            objective=g.objective,
            behaviour_weight_cap=g.behaviour_weight_cap,
            # Keep bf16 logits: token_logprobs upcasts chunk by chunk, never the whole tensor.
            fp32_output=False if self.params_dtype == torch.bfloat16 else None,
        )

    def _run(
        self, mbs: list[Microbatch], mode: LossMode, *, forward_only: bool, temperature: float | None = None
    ) -> list[Any]:
        """Megatron's schedule over ``mbs``; the loss closures' outputs (last stage only): metric
        dicts of tensors (grpo, sft) or :class:`~megatron_rl.training.steps.LogprobsOutput`.
        Any: the list comes back from megatron-core's schedule, which ships no types."""
        from megatron.core.pipeline_parallel import (
            get_forward_backward_func,  # lazy: megatron-core takes seconds to import; only this path needs it
        )
        from megatron.core.pipeline_parallel.p2p_communication import (
            P2PCommunicator,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        forward_step = make_forward_step(self._context(temperature), mode)
        iters = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iters,
                model=self.model,
                num_microbatches=len(mbs),
                # The p2p shape when shapes are uniform; else ignored (variable_seq_lengths).
                seq_length=max(mb.tokens.shape[1] for mb in mbs),
                micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
                forward_only=forward_only,
                pg_collection=self.pgs,
                p2p_communicator=P2PCommunicator(self.pgs.pp, self.model[0].config),
            )

    def _reduce_metrics(
        self, parts: list[dict[str, torch.Tensor]], keys: list[str], stats: dict[str, float]
    ) -> dict[str, torch.Tensor]:
        """Sum (``*_max``: max) the metrics over data-parallel replicas, on every rank: two
        all-reduces over the world, to which only each replica's reporting rank contributes."""
        local = reduce_loss_metrics(parts) if self._reports else {}
        sum_keys = [k for k in keys if not k.endswith("_max")] + list(_STAT_KEYS)
        max_keys = [k for k in keys if k.endswith("_max")]
        # The collation figures once per replica (its context-parallel ranks share its microbatches).
        counts_stats = self._reports and self.pgs.cp.rank() == 0
        local.update({k: torch.tensor(v) for k, v in stats.items()} if counts_stats else {})

        def vector(names: list[str]) -> torch.Tensor:
            if not self._reports:
                return torch.zeros(len(names), dtype=torch.float64, device=self.device)
            zero = torch.zeros((), dtype=torch.float64)
            return torch.stack([local.get(k, zero).to(self.device, torch.float64) for k in names])

        sums = vector(sum_keys)
        dist.all_reduce(sums)
        out = dict(zip(sum_keys, sums.cpu()))
        if max_keys:
            maxes = vector(max_keys)  # every *_max metric is >= 0, so 0 is a neutral element
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            out.update(zip(max_keys, maxes.cpu()))
        return out
