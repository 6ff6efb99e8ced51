"""The same weights give the same logits and gradients at every TP x PP x DP layout (gloo, CPU).

One spawn of 4 ranks runs everything, because each process start costs seconds:

1. Reference, TP=1 PP=1 (DP=4, every rank the same): build the model, save it with
   ``save_model_checkpoint``, and compute the logits and gradients of
   ``L = sum(logits**2) / (batch * seq)`` over the full batch with a plain forward/backward.
2. Each layout loads that checkpoint (never relying on RNG for equal weights), runs Megatron's
   pipeline schedule (``get_forward_backward_func``) with a ``forward_step`` closure, once with
   ``forward_only=True`` for logits and once with a backward, and compares against the reference:
   - TP=2 x PP=2, DP=1: logits and every parameter's gradient (DDP buffers).
   - TP=2 x DP=2 with the distributed optimizer: the initial weights before loading (CPU
     initialisation makes them bit-identical to TP=1's), logits, grad norm, and the parameters
     after one Adam step (an error in any gradient shard shows up in the updated parameters).
   - PP=2 x VPP=2 x DP=2 with tied embeddings: logits and every gradient, including both copies
     of the shared embedding (first stage and last stage), which Megatron keeps in sync.

Each layout's microbatch loss is scaled by ``num_microbatches * dp / (batch * seq)`` before the
schedule runs, so that after the schedule's division by the number of microbatches and DDP's
average over data-parallel ranks the gradient is that of ``L``.
"""

from __future__ import annotations

import tempfile
from functools import partial

import pytest
import torch

from tests.spawn import run_ranks
from tests.training.compare import diff_failures

BATCH, SEQ, VOCAB = 4, 8, 1000  # ids on every TP shard of the 1024-row padded vocabulary
# Per tensor, max |layout - reference| <= REL_TOL * max |reference|. Reordered fp32 sums (split
# matmuls, all-reduces, microbatch accumulation) measure up to ~1.3e-6 of the tensor's scale for
# this 4-layer model; a real bug (wrong shard, missing reduction, wrong scaling) is O(1).
REL_TOL = 1e-5

LAYOUTS = (
    # name, tensor, pipeline, virtual, variant, num_microbatches, distributed optimizer
    ("tp2_pp2", 2, 2, None, "untied", 2, False),
    ("tp2_dp2_distopt", 2, 1, None, "untied", 2, True),
    ("pp2_vpp2_dp2_tied", 1, 2, 2, "tied", 2, False),
)


def _hf_config(variant: str):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=variant == "tied",
    )


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _positions(batch: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(batch, SEQ)


def _reference(variant: str, ckpt: str) -> dict:
    """TP1/PP1 weights saved to ``ckpt``; returns logits, per-parameter grads and weights."""
    from megatron_rl.training.model import build_gpt_model, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig

    model = build_gpt_model(_hf_config(variant), ParallelConfig())
    save_model_checkpoint(model, ckpt)
    logits = model(_input_ids(), _positions(BATCH), None)
    ((logits.float() ** 2).sum() / (BATCH * SEQ)).backward()
    return {
        "logits": logits.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _global_names(chunk, tied: bool) -> dict[str, str]:
    """Local parameter name -> name in the TP1/PP1 reference (layer numbers made global)."""
    from megatron.core.utils import unwrap_model

    module = unwrap_model(chunk)
    out = {}
    for name, _ in module.named_parameters():
        ref = name
        if name.startswith("decoder.layers."):
            local = int(name.split(".")[2])
            global_index = module.decoder.layers[local].layer_number - 1
            ref = name.replace(f"decoder.layers.{local}.", f"decoder.layers.{global_index}.", 1)
        if tied and name == "output_layer.weight":
            ref = "embedding.word_embeddings.weight"  # last stage's copy of the shared weight
        out[name] = ref
    return out


def _shard(param, name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The slice of a TP1 tensor that this rank's ``param`` holds.

    Column-parallel weights (and the vocab-parallel embedding) split dim 0, row-parallel dim 1.
    QKV is laid out per query group, so its dim-0 split is contiguous too. The SwiGLU fc1 weight
    is ``[gate; up]`` and each rank holds ``[gate_r; up_r]``.
    """
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def _loss(scale: float, output: torch.Tensor):
    loss = (output.float() ** 2).sum() * scale
    return loss, {"logits": output.detach()}


def _forward_step(data_iterator, model):
    ids = next(data_iterator)
    return model(ids, _positions(ids.shape[0]), None), partial(_loss, _forward_step.scale)


def _run_schedule(chunks, pgs, ids: torch.Tensor, m: int, scale: float, forward_only: bool):
    """Megatron's schedule over ``m`` microbatches of ``ids``; the last stage's logits list."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    micro = list(ids.chunk(m))
    _forward_step.scale = scale
    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=[iter(micro) for _ in chunks],
        model=chunks,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=micro[0].shape[0],
        forward_only=forward_only,
        pg_collection=pgs,
        p2p_communicator=P2PCommunicator(pgs.pp, chunks[0].config),
    )


def _gather_logits(outputs: list, tp_group, dp_group) -> torch.Tensor:
    """Full-vocabulary, full-batch logits from the vocab-parallel, DP-split microbatch outputs."""
    import torch.distributed as dist

    local = torch.cat([o["logits"] for o in outputs], dim=0)
    parts = [torch.empty_like(local) for _ in range(tp_group.size())]
    dist.all_gather(parts, local, group=tp_group)
    local = torch.cat(parts, dim=-1)
    parts = [torch.empty_like(local) for _ in range(dp_group.size())]
    dist.all_gather(parts, local, group=dp_group)
    return torch.cat(parts, dim=0)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |b|): the error and the scale it is judged against."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item(), b.abs().max().item()


def _wrap_ddp(chunks, distributed_optimizer: bool):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def _compare(
    chunks, names, ref_tensors: dict, tp_rank: int, tp: int, label: str, value=lambda p: p.detach()
) -> dict:
    """``value(param)`` of every local parameter against its shard of the reference tensor."""
    return {
        f"{label} {chunk_names[local]}": _max_diff(
            value(p), _shard(p, local, ref_tensors[chunk_names[local]], tp_rank, tp)
        )
        for chunk, chunk_names in zip(chunks, names)
        for local, p in chunk.named_parameters()
    }


def _run_layout(layout: tuple, ref: dict, ckpt: str) -> dict:
    """Load the reference checkpoint at ``layout``, compare logits and grads; return max diffs."""
    from megatron.core import parallel_state as ps

    from megatron_rl.training.model import build_model_chunks, load_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, process_groups

    name, tp, pp, vpp, variant, m, distopt = layout
    cfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp)
    chunks = build_model_chunks(_hf_config(variant), cfg)
    names = [_global_names(c, variant == "tied") for c in chunks]
    pgs = process_groups()
    dp, dp_rank, tp_rank = pgs.dp.size(), pgs.dp.rank(), pgs.tp.rank()
    out = {"layout": name, "diffs": {}}
    if pp == 1:
        # Same seed, built first as the reference was: CPU initialisation draws every full
        # weight and keeps this rank's shard, so the initial model does not depend on TP.
        out["diffs"] = _compare(chunks, names, ref["params"], tp_rank, tp, "init")
    load_model_checkpoint(chunks, ckpt)
    ddp = _wrap_ddp(chunks, distopt)
    ids = _input_ids().chunk(dp)[dp_rank]
    scale = m * dp / (BATCH * SEQ)
    logits = _run_schedule(ddp, pgs, ids, m, scale, forward_only=True)
    if ps.is_pipeline_last_stage():
        out["diffs"]["logits"] = _max_diff(_gather_logits(logits, pgs.tp, pgs.dp), ref["logits"])
    for w in ddp:
        w.zero_grad_buffer()
    _run_schedule(ddp, pgs, ids, m, scale, forward_only=False)
    if distopt:
        out["diffs"].update(_step_and_compare(ddp, chunks, names, ref, tp_rank, tp))
    else:
        out["diffs"].update(
            _compare(chunks, names, ref["grads"], tp_rank, tp, "grad", value=lambda p: p.main_grad)
        )
    return out


def _step_and_compare(ddp, chunks, names, ref, tp_rank: int, tp: int) -> dict:
    """One Adam step with Megatron's distributed optimizer; compare grad norm and parameters.

    The first Adam step moves a parameter by ``lr * g / (|g| + eps)``; with ``lr = eps = 1`` and
    gradients well below 1 that is close to ``g`` itself, so an error in any gradient shard shows
    up at its own size (Megatron's distributed optimizer supports only Adam).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1.0,
            adam_eps=1.0,
            weight_decay=0.0,
            use_distributed_optimizer=True,
            clip_grad=1e6,
        ),
        ddp,
    )
    ok, grad_norm, _ = opt.step()
    assert ok
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref["grads"].values())).item()
    stepped = {n: p - ref["grads"][n] / (ref["grads"][n].abs() + 1.0) for n, p in ref["params"].items()}
    return {
        "grad norm": (abs(grad_norm - ref_norm), ref_norm),
        **_compare(chunks, names, stepped, tp_rank, tp, "stepped"),
    }


def _all_layouts(rank: int, world_size: int, ckpt_root: str) -> list[dict]:
    import os

    # A CPU test by design (gloo ranks sharing the machine), also where a GPU is present.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_rl.training.parallel import ParallelConfig, parallel_layout

    with parallel_layout(ParallelConfig(), seed=1234):
        refs = {v: _reference(v, f"{ckpt_root}/{v}") for v in ("untied", "tied")}
    results = []
    for layout in LAYOUTS:
        cfg = ParallelConfig(
            tensor_parallel=layout[1], pipeline_parallel=layout[2], virtual_pipeline=layout[3]
        )
        with parallel_layout(cfg, seed=1234):
            results.append(_run_layout(layout, refs[layout[4]], f"{ckpt_root}/{layout[4]}"))
    return results


@pytest.mark.distributed
def test_logits_and_grads_match_tp1_pp1_at_every_layout():
    with tempfile.TemporaryDirectory() as ckpt_root:
        per_rank = run_ranks(_all_layouts, 4, args=(ckpt_root,), timeout=150)
    # init: bit-identical; everything else relative to the tensor's scale, which must be > 0.
    bad, compared = diff_failures(
        per_rank, lambda what, scale: 0.0 if what.startswith("init") else REL_TOL * scale, require_scale=True
    )
    assert not bad, "\n".join(bad)
    assert set(compared) == {layout[0] for layout in LAYOUTS}, compared
    # Each rank holds a nonempty set of parameters (+ logits on last stages): all compared.
    assert all(n >= 4 * 5 for n in compared.values()), compared
