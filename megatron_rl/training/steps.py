"""Forward steps and loss closures given to Megatron's pipeline schedule.

``make_forward_step(ctx, mode)`` returns ``forward_step(data_iterator, model)``, which runs the
model on the next :class:`~megatron_rl.batching.collate.Microbatch` and returns
``(output, partial(loss_fn, ctx, microbatch))``. On the last pipeline stage the schedule calls the
closure with the vocab-parallel logits ``[R, S, V_pad / tp]`` (``[1, N, V_pad / tp]`` at the
microbatch's :class:`LogitPositions`, below). Three modes:

- ``grpo``: taken-token log-probs (:func:`token_logprobs` over the TP group, never the full
  vocabulary), then :func:`grpo_loss` with the microbatch's per-token weights.
- ``sft``: ``-sum_t w_t log p(label_t)``; the weights are 0 on prompt tokens and ``1 / answer
  tokens`` of the whole minibatch on answer tokens (``batching/sft.py``), so this is the minibatch's
  mean answer-token NLL once summed over microbatches and ranks.
- ``logprobs``: forward only; every sequence's completion-token log-probs.

Padded vocabulary: ids ``>= vocab_size`` exist only to make the output layer divide evenly; the
generator never samples them, so their logits are set to -inf (on the shard that holds them)
before any log-softmax. The trainer's distribution is then the generator's.

Logits only where a loss or log-prob is read. A policy-gradient loss uses the log-prob of
completion tokens only; prompt tokens (a third of the tokens in a typical RL batch, and the output
layer plus its log-softmax are a third of a small model's FLOPs) need hidden states, not logits.
``_forward_step`` therefore hands the output layer only the hidden states at the microbatch's
:class:`LogitPositions` (``loss_mask | loss_weights != 0``, computed on the host, so no device
sync) through a forward pre-hook, and the closure scatters the taken-token log-probs and
entropies back into ``[R, S]`` (zeros elsewhere: every consumer masks those positions). The
final norm is per token, so this is exact; it is skipped where the output layer's input is
sequence-sharded (sequence parallelism gathers it inside the layer) or multi-token prediction
reads the full hidden states.

Normalisation is never computed here: the per-token ``loss_weights`` (``batching/weights.py``) sum
to 1 over the global minibatch, so a microbatch's loss is a plain partial sum.

Gradient scaling -- why ``calculate_per_token_loss=True`` and a finalize step without token scaling.
With data-parallel replicas ``d = 1..D``, replica ``d`` running ``M_d`` microbatches with losses
``L_dm = sum_{t in m} w_t l_t``, one optimizer step must use ``g = grad sum_d sum_m L_dm``.

- Megatron's default (2-tuple from the closure, ``calculate_per_token_loss=False``) backpropagates
  ``L_dm / M_d`` and DDP pre-scales by ``1 / D`` before a sum all-reduce, giving
  ``(1/D) sum_d (1/M_d) sum_m grad L_dm``: every closure would have to multiply by ``M_d * D``, a
  factor that differs between replicas, only for Megatron to divide it out again.
- With ``TransformerConfig.calculate_per_token_loss=True`` and a 3-tuple ``(loss, num_tokens,
  metrics)`` the schedule backpropagates ``loss`` as returned (no ``/ M``, no ``/ num_tokens``:
  ``schedules.forward_step_calc_loss``), and DDP uses ``gradient_scaling_factor = 1`` with a sum
  all-reduce (``DistributedDataParallel.__init__``; ``average_in_collective`` must stay False).
  ``finalize_model_grads`` would then divide by the summed ``num_tokens``; the trainer installs
  :func:`finalize_grads_summed`, which calls it with ``num_tokens=None``. Every factor is 1 and
  ``g`` is exactly ``sum_d sum_m grad L_dm``.
- TP: every TP rank computes the same scalar loss (the log-softmax statistics are all-reduced
  inside :func:`token_logprobs`); each rank backpropagates into its vocabulary shard and the output
  layer's backward all-reduces the hidden-state gradient over TP, so each shard's contribution is
  counted once. PP: the loss exists on the last stage; gradients travel back by p2p. Tied
  embeddings: ``finalize_model_grads`` sums the first and last stage copies' gradients.
- MoE auxiliary losses would not be divided by ``M`` under this flag; MoE models are not built.

Packed rows (several sequences per row, ``cu_seqlens``): the model always gets
``PackedSeqParams(qkv_format="thd")`` and no attention mask. With Transformer Engine, TE's
variable-length attention keeps each sequence to itself; with Megatron's local layer spec,
:class:`~megatron_rl.training.attention.SegmentCausalAttention` (``training/model.py`` puts it in
the spec) runs one causal SDPA per sequence -- no dense ``[T, T]`` mask on either path. On both,
Megatron's ``SelfAttention`` restarts RoPE at every ``cu_seqlens`` entry, so a packed sequence is
computed exactly as it is alone (or in a padded row), up to fp32 reordering.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict

import torch

from megatron_rl.algorithms.logprobs import token_logprobs
from megatron_rl.algorithms.loss import decoupled_loss, grpo_loss
from megatron_rl.batching.collate import PER_POSITION_FIELDS, Microbatch
from megatron_rl.training.replay import set_routing

if TYPE_CHECKING:
    import torch.distributed as dist

    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "LogitPositions",
    "LossMode",
    "StepContext",
    "finalize_grads_summed",
    "finalize_sft_metrics",
    "grpo_loss_fn",
    "logprobs_fn",
    "make_forward_step",
    "mask_padded_vocab",
    "metric_keys",
    "model_inputs",
    "sft_loss_fn",
    "taken_token_logprobs",
]

LossMode = Literal["grpo", "sft", "logprobs"]


class LogprobsOutput(TypedDict):
    """What the ``logprobs`` closure reports for one microbatch."""

    seq_index: list[int]  # the microbatch's sequences, in row / segment order
    logprobs: list[torch.Tensor]  # [C_i] completion-token log-probs per sequence


#: A closure's result as the schedule takes it with ``calculate_per_token_loss``:
#: ``(loss, loss tokens, metrics)`` (metric sums, or :class:`LogprobsOutput`).
LossOutput: TypeAlias = "tuple[torch.Tensor, torch.Tensor, Mapping[str, object]]"
LossFn: TypeAlias = "Callable[[StepContext, Microbatch, LogitPositions | None, torch.Tensor], LossOutput]"
LossClosure: TypeAlias = "Callable[[torch.Tensor], LossOutput]"  # logits -> LossOutput
#: ``forward_step(data_iterator, model) -> (output, loss closure over the logits)``.
ForwardStep: TypeAlias = "Callable[[Iterator[Microbatch], MegatronModule], tuple[torch.Tensor, LossClosure]]"

_TENSOR_FIELDS = (*PER_POSITION_FIELDS, "cu_seqlens")


@dataclass(frozen=True)
class StepContext:
    """What every microbatch of a step shares; fixed before the schedule runs."""

    tp_group: dist.ProcessGroup | None  # TP group of the vocab-parallel logits (None: unsharded)
    vocab_size: int  # the tokenizer's vocabulary; logits of ids >= this are masked to -inf
    device: torch.device  # where the model runs; microbatches are moved there
    temperature: float = 1.0  # sampling temperature of the behaviour log-probs (GRPO only)
    chunk_size: int | None = None  # tokens per log-prob chunk; None = automatic
    eps_low: float = 0.2  # GRPO clip range [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    objective: Literal["magistral", "decoupled"] = "magistral"  # GRPO policy objective (algorithms/loss.py)
    behaviour_weight_cap: float = 0.0  # decoupled: tokens with proximal / behaviour above this are left out
    fp32_output: bool | None = None  # Float16Module's fp32_output (False: keep bf16 logits)
    select_positions: bool = True  # logits only at LogitPositions (see the module docstring)


def mask_padded_vocab(
    logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``logits`` ``[..., V_local]`` (this rank's shard, ids ``[r V_local, (r+1) V_local)``) with
    ids ``>= vocab_size`` set to -inf. Returns the input itself when the shard has no such id,
    else a masked copy (the gradient of masked entries is 0)."""
    v_local = logits.shape[-1]
    start = v_local * (tp_group.rank() if tp_group is not None else 0)
    if start + v_local <= vocab_size:
        return logits
    padded = torch.arange(start, start + v_local, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, float("-inf"))


def _fill_padded_vocab_(logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None) -> None:
    """Set ids ``>= vocab_size`` of this rank's ``logits`` shard ``[..., V_local]`` to -inf in
    place, without recording it for autograd (see :func:`taken_token_logprobs` for why)."""
    v_local = logits.shape[-1]
    start = v_local * (tp_group.rank() if tp_group is not None else 0)
    first = max(0, vocab_size - start)
    if first < v_local:
        with torch.no_grad():
            logits[..., first:].fill_(float("-inf"))


def taken_token_logprobs(
    ctx: StepContext, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[R, S]`` (fp32) of ``labels`` ``[R, S]`` under the vocab-parallel
    ``logits`` ``[R, S, V_local]`` with the padded vocabulary masked. Labels were checked against
    ``vocab_size`` when the batch was built, so no per-microbatch host sync here.

    The padded ids are set to -inf *in place*, outside autograd: :func:`mask_padded_vocab`'s copy
    (and the copy its backward makes) would cost two passes over the largest activation of the
    step. This is exact: no op before saved the logits for its backward (the output layer keeps
    its input and weight), and the gradient that reaches a -inf logit from the log-softmax is
    ``onehot - softmax = 0 - 0`` (labels are never padded ids), what the mask's backward gives."""
    _fill_padded_vocab_(logits, ctx.vocab_size, ctx.tp_group)
    return token_logprobs(
        logits,
        labels,
        temperature=temperature,
        chunk_size=ctx.chunk_size,
        tp_group=ctx.tp_group,
        check_targets=False,
    )


@dataclass(frozen=True)
class LogitPositions:
    """The ``(row, position)`` pairs of a microbatch whose logits a closure reads, in row-major
    order, on the model's device."""

    rows: torch.Tensor  # [N] int64
    cols: torch.Tensor  # [N] int64

    @staticmethod
    def of(mb: Microbatch, device: torch.device) -> LogitPositions:
        """Positions with a completion label or a nonzero loss weight (host computation)."""
        rows, cols = (mb.loss_mask | (mb.loss_weights != 0)).nonzero(as_tuple=True)
        return LogitPositions(rows.to(device, non_blocking=True), cols.to(device, non_blocking=True))

    def scatter(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``values`` ``[N]`` placed into zeros of ``shape`` ``[R, S]`` (differentiable)."""
        return values.new_zeros(shape).index_put((self.rows, self.cols), values)


class _PositionSlot:
    """The positions for the output layer's current forward, read by its forward pre-hook."""

    def __init__(self) -> None:
        self.positions: LogitPositions | None = None

    def hook(self, module: torch.nn.Module, args: tuple[object, ...]) -> tuple[object, ...] | None:
        """Hidden states ``[S, B, H]`` -> ``[N, 1, H]`` at the set positions (the model then
        returns logits ``[1, N, V]``); unchanged when none are set."""
        del module
        if self.positions is None:
            return None
        hidden = args[0]
        assert isinstance(hidden, torch.Tensor)
        return (hidden[self.positions.cols, self.positions.rows].unsqueeze(1), *args[1:])


_SLOTS: weakref.WeakKeyDictionary[torch.nn.Module, _PositionSlot] = weakref.WeakKeyDictionary()


def _position_slot(model: MegatronModule) -> _PositionSlot | None:
    """The slot of the chunk's output layer when it can run on selected positions (see the
    module docstring), installing its hook on first use; else None."""
    from megatron.core.utils import (
        unwrap_model,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    if layer is None or getattr(layer, "sequence_parallel", False) or gpt.config.mtp_num_layers:
        return None
    slot = _SLOTS.get(layer)
    if slot is None:
        slot = _SLOTS[layer] = _PositionSlot()
        layer.register_forward_pre_hook(slot.hook)
    return slot


def _full_logprobs(
    ctx: StepContext,
    mb: Microbatch,
    positions: LogitPositions | None,
    logits: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Taken-token log-probs and entropies ``[R, S]`` from full logits ``[R, S, V]``, or from
    logits ``[1, N, V]`` at ``positions`` (scattered back; zeros elsewhere)."""
    if positions is None:
        return taken_token_logprobs(ctx, logits, mb.labels, temperature)
    labels = mb.labels[positions.rows, positions.cols].unsqueeze(0)
    logp, entropy = taken_token_logprobs(ctx, logits, labels, temperature)
    return positions.scatter(logp[0], mb.labels.shape), positions.scatter(entropy[0], mb.labels.shape)


def _num_tokens(mb: Microbatch) -> torch.Tensor:
    return (mb.loss_weights != 0).sum().to(torch.int)


def grpo_loss_fn(
    ctx: StepContext, mb: Microbatch, positions: LogitPositions | None, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one microbatch: ``(sum_t w_t loss_t, loss tokens, metric sums + "loss")``.

    The decoupled objective takes the proximal log-probs the microbatch carries (computed before
    the step's first optimizer step) or, when it carries none, the ones of this very forward: the
    weights being trained are then still the step's starting weights (its first minibatch)."""
    logp, entropy = _full_logprobs(ctx, mb, positions, logits, ctx.temperature)
    clip: dict[str, Any] = {"eps_low": ctx.eps_low, "eps_high": ctx.eps_high, "entropy": entropy}
    if ctx.objective == "decoupled":
        proximal = mb.proximal_logprobs if mb.proximal_logprobs is not None else logp.detach()
        loss, metrics = decoupled_loss(
            logp,
            proximal,
            mb.behaviour_logprobs,
            mb.advantages,
            mb.loss_weights,
            weight_cap=ctx.behaviour_weight_cap,
            **clip,
        )
    else:
        loss, metrics = grpo_loss(logp, mb.behaviour_logprobs, mb.advantages, mb.loss_weights, **clip)
    metrics["loss"] = loss.detach().float()
    return loss, _num_tokens(mb), metrics


def _sft_loss(
    logp: torch.Tensor, weights: torch.Tensor, entropy: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-sum_t w_t logp_t`` ``[R, S]`` -> scalar, with metric sums over tokens of weight != 0."""
    mask = weights != 0
    zero = torch.zeros_like(logp)
    loss = -torch.where(mask, logp * weights, zero).sum()
    with torch.no_grad():
        metrics = {
            "tokens": mask.float().sum(),
            "nll_sum": -torch.where(mask, logp.detach(), zero).sum(),
            "entropy_sum": torch.where(mask, entropy.detach(), zero).sum(),
        }
    return loss, metrics


def sft_loss_fn(
    ctx: StepContext, mb: Microbatch, positions: LogitPositions | None, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token loss on answer tokens: ``(-sum_t w_t logp_t, loss tokens, metric sums)``."""
    logp, entropy = _full_logprobs(ctx, mb, positions, logits)
    loss, metrics = _sft_loss(logp, mb.loss_weights, entropy)
    metrics["loss"] = loss.detach().float()
    return loss, _num_tokens(mb), metrics


def logprobs_fn(
    ctx: StepContext, mb: Microbatch, positions: LogitPositions | None, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, LogprobsOutput]:
    """Forward only: ``{"seq_index": [...], "logprobs": [[C_i] per sequence]}`` for the
    microbatch's sequences (at ``ctx.temperature``); the loss returned is a 0 placeholder."""
    with torch.no_grad():
        logp, _ = _full_logprobs(ctx, mb, positions, logits, ctx.temperature)
    out: LogprobsOutput = {"seq_index": list(mb.seq_index), "logprobs": mb.split_per_sequence(logp)}
    return logp.new_zeros(()), _num_tokens(mb), out


_LOSS_FNS: dict[str, LossFn] = {"grpo": grpo_loss_fn, "sft": sft_loss_fn, "logprobs": logprobs_fn}


def metric_keys(mode: LossMode, objective: str = "magistral") -> list[str]:
    """The metric names a mode's closure returns, known on every rank (also on pipeline stages
    that never run the loss): read off the loss functions applied to empty tensors."""
    empty = torch.zeros(0)
    if mode == "grpo" and objective == "decoupled":
        metrics = decoupled_loss(empty, empty, empty, empty, empty, entropy=empty)[1]
    elif mode == "grpo":
        metrics = grpo_loss(empty, empty, empty, empty, entropy=empty)[1]
    elif mode == "sft":
        metrics = _sft_loss(empty, empty, empty)[1]
    else:
        return []
    return sorted([*metrics, "loss"])


def finalize_sft_metrics(summed: dict[str, torch.Tensor]) -> dict[str, float]:
    """Reduced SFT sums -> ``tokens``, ``nll_mean`` (mean answer-token NLL) and ``entropy_mean``."""
    n = max(float(summed["tokens"]), 1.0)
    return {
        "tokens": float(summed["tokens"]),
        "nll_mean": float(summed["nll_sum"]) / n,
        "entropy_mean": float(summed["entropy_sum"]) / n,
    }


def _to_device(mb: Microbatch, device: torch.device) -> Microbatch:
    if mb.tokens.device == device:
        return mb
    moved = {
        name: getattr(mb, name).to(device, non_blocking=True)
        for name in _TENSOR_FIELDS
        if getattr(mb, name) is not None
    }
    return dataclasses.replace(mb, **moved)


def model_inputs(mb: Microbatch, *, device: torch.device | None = None) -> dict[str, object]:
    """``GPTModel.forward`` arguments for a (host) microbatch, on ``device`` (default: the
    microbatch's).

    Padded rows: plain causal attention (``attention_mask=None``); right padding sits after every
    real token, so no real token attends to it. Packed rows: ``PackedSeqParams`` (``thd``) with
    the segment starts ``cu_seqlens`` (the tail padding is a segment of its own) and no mask; the
    attention keeps each segment to itself (see the module docstring).
    """
    from megatron.core.packed_seq_params import (
        PackedSeqParams,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    device = device or mb.tokens.device
    inputs: dict[str, object] = {
        "input_ids": mb.tokens.to(device),
        "position_ids": mb.position_ids.to(device),
        "attention_mask": None,
    }
    if mb.layout != "packed":
        return inputs
    starts = mb.packed_cu_seqlens()
    cu = starts.to(device, torch.int32)
    longest = int((starts[1:] - starts[:-1]).max())
    inputs["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return inputs


def _forward_step(
    ctx: StepContext, loss_fn: LossFn, data_iterator: Iterator[Microbatch], model: MegatronModule
) -> tuple[torch.Tensor, LossClosure]:
    mb = next(data_iterator)
    set_routing(model, mb.routed_experts)  # routing replay: the generator's experts (or none)
    kwargs = model_inputs(mb, device=ctx.device)
    if ctx.fp32_output is not None:
        kwargs["fp32_output"] = ctx.fp32_output
    slot = _position_slot(model) if ctx.select_positions else None
    if slot is None:
        return model(**kwargs), partial(loss_fn, ctx, _to_device(mb, ctx.device), None)
    positions = slot.positions = LogitPositions.of(mb, ctx.device)
    try:
        output = model(**kwargs)
    finally:
        slot.positions = None
    return output, partial(loss_fn, ctx, _to_device(mb, ctx.device), positions)


def make_forward_step(ctx: StepContext, mode: LossMode) -> ForwardStep:
    """``forward_step(data_iterator, model) -> (output, partial(loss_fn, ctx, microbatch))`` for
    ``get_forward_backward_func()``; the iterator yields :class:`Microbatch` objects."""
    if mode not in _LOSS_FNS:
        raise ValueError(f"mode must be one of {sorted(_LOSS_FNS)}, got {mode!r}")
    return partial(_forward_step, ctx, _LOSS_FNS[mode])


def finalize_grads_summed(
    model: list[MegatronModule],
    num_tokens: torch.Tensor | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool = False,
) -> None:
    """``config.finalize_model_grads_func``: Megatron's ``finalize_model_grads`` (DP all-reduce,
    tied-embedding and layernorm reductions) without dividing by the token count -- the per-token
    weights already normalise (see the module docstring)."""
    from megatron.core.distributed import (
        finalize_model_grads,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    del num_tokens  # summed by the schedule from the closures; informational only
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
