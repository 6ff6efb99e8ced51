"""Checkpoints: exact resume, resume at another TP/PP, atomic saves, clear errors.

Two spawns of 2 gloo ranks carry the distributed part (each process start costs seconds):

1. Layout A = TP1 PP1 DP2: four training steps of a tiny Llama (Megatron's pipeline schedule,
   DDP, the plain Megatron Adam, an LR scheduler in warm-up then cosine), a checkpoint after
   step 2, and draws from every RNG right after the save.
2. Fresh processes load the step-2 checkpoint and run steps 3 and 4 at
   - layout A again: losses, LRs and grad norms bit-identical; the RNG draws identical;
   - TP2, PP2 and PP2 x VPP2: the same within REL_TOL (grad norms NORM_REL_TOL); RNGs
     reseeded deterministically at TP2, the default generator shared by the TP ranks and the
     tensor-parallel stream distinct per TP rank;
   - layout A, model only (fresh optimizer and scheduler): step 3 still matches (it depends on
     the weights only) but step 4 does not -- the step-4 comparison above does see the
     optimizer and scheduler state.

The data of each step depends only on the step. The step-3 loss is computed with the weights
after step 2, so it checks the model; the step-4 loss also checks Adam's moments and the LR.

The rest runs in this process at TP1 PP1 (the ``single_rank`` fixture).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.spawn import run_ranks

BATCH, SEQ, VOCAB, MICRO = 8, 16, 1000, 2
SEED = 1234
SAVE_AFTER = 2
# max |loss_B - loss_A| <= REL_TOL * |loss_A|. At another TP/PP only the order of fp32 sums
# changes (split matmuls, all-reduces); that moves the mean loss by ~1e-7 of itself.
REL_TOL = 1e-6
# The grad norm sums squares of every gradient element, each of which moves by up to ~1e-6 of its
# tensor's scale at another layout (tests/training/test_layouts.py): measured 5e-7 here at TP2.
NORM_REL_TOL = 1e-5


# -- a tiny training run ------------------------------------------------------------------------


def _hf_config(hidden: int = 64, tied: bool = False):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and next-token labels ``[BATCH, SEQ]`` of ``step``: a function of the step only."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _build(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    *,
    hidden: int = 64,
    tied: bool = False,
    distributed_optimizer: bool = False,
):
    """Model chunks wrapped in Megatron's DDP, its Adam, and an LR scheduler (warm-up, cosine)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_rl.training.model import build_model_chunks
    from megatron_rl.training.parallel import ParallelConfig

    chunks = build_model_chunks(
        _hf_config(hidden, tied),
        ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp),
    )
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    ddp = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in ddp] if len(ddp) > 1 else ddp[0].no_sync
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-4,
            weight_decay=0.01,
            clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer,
        ),
        ddp,
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=2e-4,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    return ddp, opt, sched


def _loss(scale: float, token_loss: torch.Tensor):
    total = token_loss.float().sum()
    return total * scale, {"loss_sum": total.detach()}


def _forward_step(data_iterator, model):
    ids, labels = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(ids.shape[0], SEQ)
    # The schedule divides by the microbatch count and DDP averages over DP ranks: scaling the
    # summed token loss by MICRO * dp / (BATCH * SEQ) makes the gradient that of the mean loss.
    return model(ids, positions, None, labels=labels), partial(_loss, _forward_step.scale)


def _train_step(ddp, opt, sched, step: int) -> dict:
    """One optimizer step on ``_batch(step)``: mean token loss (last stages), LR, grad norm."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_rl.training.parallel import process_groups

    pgs = process_groups()
    dp = pgs.dp.size()
    ids, labels = (t.chunk(dp)[pgs.dp.rank()] for t in _batch(step))
    _forward_step.scale = MICRO * dp / (BATCH * SEQ)
    for w in ddp:
        w.zero_grad_buffer()
    opt.zero_grad()
    micro = list(zip(ids.chunk(MICRO), labels.chunk(MICRO)))
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=[iter(micro) for _ in ddp],
        model=ddp,
        num_microbatches=MICRO,
        seq_length=SEQ,
        micro_batch_size=BATCH // dp // MICRO,
        forward_only=False,
        pg_collection=pgs,
        p2p_communicator=P2PCommunicator(pgs.pp, ddp[0].config),
    )
    lr = opt.param_groups[0]["lr"]
    ok, grad_norm, _ = opt.step()
    assert ok
    sched.step(increment=1)
    loss = None
    if outputs:  # last pipeline stage
        total = torch.stack([o["loss_sum"] for o in outputs]).sum()
        dist.all_reduce(total, group=pgs.dp)
        loss = total.item() / (BATCH * SEQ)
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm}


def _rng_draws() -> dict:
    """One draw from every generator a checkpoint restores."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tensor_parallel = torch.rand(4).tolist()
    return {
        "python": random.random(),
        "numpy": float(np.random.rand()),
        "torch": torch.rand(4).tolist(),
        "tensor_parallel": tensor_parallel,
    }


# -- the distributed runs -----------------------------------------------------------------------


def _run_layout_a(rank: int, world_size: int, root: str) -> dict:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU test by design, also where a GPU is present
    from megatron_rl.training.checkpoint import save_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(), seed=SEED)
    try:
        ddp, opt, sched = _build()
        steps, draws = {}, None
        for step in range(1, 5):
            steps[step] = _train_step(ddp, opt, sched, step)
            if step == SAVE_AFTER:
                save_checkpoint(
                    root,
                    step,
                    ddp,
                    opt,
                    sched,
                    seed=SEED,
                    extra={"sampler": {"epoch": 0, "cursor": step * BATCH}},
                )
                draws = _rng_draws()
        return {"steps": steps, "draws": draws}
    finally:
        destroy_parallel()


def _resume(
    layout: str, tp: int, pp: int, root: str, *, vpp: int | None = None, with_optimizer: bool = True
) -> dict:
    from megatron_rl.training.checkpoint import load_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(
        ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp), seed=SEED + 1
    )
    try:
        ddp, opt, sched = _build(tp, pp, vpp)
        if with_optimizer:
            step, extra = load_checkpoint(root, ddp, opt, sched)
        else:
            step, extra = load_checkpoint(root, ddp)
        out = {"layout": layout, "step": step, "extra": extra, "draws": _rng_draws()}
        if tp > 1:  # reseeding is deterministic: a second load gives the same streams
            load_checkpoint(root, ddp, opt, sched)
            out["draws_again"] = _rng_draws()
        out["steps"] = {s: _train_step(ddp, opt, sched, s) for s in (3, 4)}
        return out
    finally:
        destroy_parallel()


def _run_resumes(rank: int, world_size: int, root: str) -> list[dict]:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return [
        _resume("same", 1, 1, root),
        _resume("tp2", 2, 1, root),
        _resume("pp2", 1, 2, root),
        _resume("pp2 vpp2", 1, 2, root, vpp=2),
        _resume("model only", 1, 1, root, with_optimizer=False),
    ]


def _close(a: float, b: float, tol: float = REL_TOL) -> bool:
    return abs(a - b) <= tol * abs(b)


def _matches(got: dict, want: dict, exact: bool) -> bool:
    """A resumed step against the uninterrupted one: bit-exact, or within the tolerances (the
    LR always exactly; the loss where this rank has it, i.e. on a last pipeline stage)."""
    if exact:
        return got == want
    return (
        got["lr"] == want["lr"]
        and _close(got["grad_norm"], want["grad_norm"], NORM_REL_TOL)
        and (got["loss"] is None or _close(got["loss"], want["loss"]))
    )


@pytest.mark.distributed
def test_resume_is_exact_at_same_layout_and_matches_at_other_tp_pp():
    with tempfile.TemporaryDirectory() as root:
        ref = run_ranks(_run_layout_a, 2, args=(root,), timeout=120)
        resumed = run_ranks(_run_resumes, 2, args=(root,), timeout=180)
    ref_steps = ref[0]["steps"]
    assert ref[1]["steps"] == ref_steps  # DP ranks agree on the reduced loss
    assert ref_steps[3]["loss"] != ref_steps[4]["loss"]  # training moves
    for rank, legs in enumerate(resumed):
        for leg in legs:
            where = f"rank {rank} {leg['layout']}"
            assert leg["step"] == SAVE_AFTER, where
            assert leg["extra"] == {"sampler": {"epoch": 0, "cursor": SAVE_AFTER * BATCH}}, where
            if leg["layout"] != "model only":
                for s in (3, 4):
                    assert _matches(leg["steps"][s], ref_steps[s], leg["layout"] == "same"), (
                        where,
                        s,
                        leg["steps"][s],
                        ref_steps[s],
                    )
    by_layout = {leg["layout"]: [legs[i] for legs in resumed] for i, leg in enumerate(resumed[0])}
    # Same layout: every rank continues its own RNG streams exactly.
    assert [leg["draws"] for leg in by_layout["same"]] == [r["draws"] for r in ref]
    # TP2: reseeded, deterministically; TP ranks share the default generator (replicated
    # activations need equal dropout masks) and differ in the tensor-parallel stream.
    tp2 = by_layout["tp2"]
    assert all(leg["draws"] == leg["draws_again"] for leg in tp2)
    assert tp2[0]["draws"]["torch"] == tp2[1]["draws"]["torch"]
    assert tp2[0]["draws"]["tensor_parallel"] != tp2[1]["draws"]["tensor_parallel"]
    assert tp2[0]["draws"] != ref[0]["draws"]
    # PP2 (also interleaved): the loss lives on the last stage only; it was compared above.
    for layout in ("pp2", "pp2 vpp2"):
        assert [leg["steps"][3]["loss"] is None for leg in by_layout[layout]] == [True, False]
    # Without the optimizer and scheduler state, step 3 (weights only) still matches but step 4
    # does not: the step-4 comparisons above are sensitive to that state.
    model_only = by_layout["model only"][0]["steps"]
    assert model_only[3]["loss"] == ref_steps[3]["loss"]
    assert not _close(model_only[4]["loss"], ref_steps[4]["loss"])
    assert model_only[3]["lr"] != ref_steps[3]["lr"]


# -- single process: atomicity, errors, extra ---------------------------------------------------


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_latest_ignores_partial_checkpoints_and_keep_last_prunes_after_completion(single_rank, tmp_path):
    import torch.distributed as dist

    from megatron_rl.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.training.checkpoint_manifest import CheckpointError, latest_checkpoint

    assert latest_checkpoint(tmp_path / "nothing-here") is None
    ddp, opt, sched = _build()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        load_checkpoint(tmp_path, ddp)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, ddp, opt, sched, keep_last=2)
    assert _names(tmp_path) == ["latest", "step_00000001", "step_00000002"]
    # A save that crashed before its marker: a tmp dir with partial files, and a step folder
    # that was renamed by hand without one. Neither is ever the latest.
    crashed = tmp_path / "step_00000003.tmp-0badc0de"
    (crashed / "dist").mkdir(parents=True)
    (crashed / "dist" / "__0_0.distcp").write_bytes(b"partial")
    unmarked = tmp_path / "step_00000004"
    (unmarked / "dist").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    (tmp_path / "latest").write_text("step_00000004\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    for incomplete in (crashed, unmarked):
        with pytest.raises(CheckpointError, match="incomplete checkpoint"):
            load_checkpoint(incomplete, ddp)
    # A save that fails part-way (the scheduler's numpy float is not JSON) deletes nothing and
    # completes nothing, so keep_last has not pruned step 1 yet.
    bad_sched = type(sched)(
        opt,
        init_lr=2e-4,
        max_lr=1e-3,
        min_lr=np.float32(1e-4),
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    with pytest.raises(TypeError, match="float32"):
        save_checkpoint(tmp_path, 5, ddp, opt, bad_sched, keep_last=2)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert {"step_00000001", "step_00000002"} <= set(_names(tmp_path))
    # The next complete save prunes beyond keep_last and sweeps the crashed tmp dirs; the
    # folder without a marker is not the saver's to delete.
    save_checkpoint(tmp_path, 5, ddp, opt, sched, keep_last=2)
    assert _names(tmp_path) == ["latest", "step_00000002", "step_00000004", "step_00000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000005"
    # `latest` naming a deleted checkpoint falls back to the newest complete one.
    shutil.rmtree(tmp_path / "step_00000005")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    marker = json.loads((tmp_path / "step_00000002" / "complete").read_text())
    assert marker["step"] == 2 and marker["layout"]["world_size"] == dist.get_world_size()
    assert marker["layout"]["tensor_parallel"] == 1 and marker["versions"]["megatron_core"]


def test_extra_round_trips(single_rank, tmp_path):
    from megatron_rl.training.checkpoint import load_checkpoint, save_checkpoint

    ddp, opt, sched = _build()
    extra = {
        "sampler": {"epoch": 3, "cursor": 1234, "order_seed": 7},
        "policy_version": 42,
        "note": "ünïcode",
        "ratio": 0.125,
        "flags": [True, None],
    }
    # Saved before the first optimizer step (no Adam state yet): loading resets the optimizer,
    # which has stepped since, and it steps again from there.
    path = save_checkpoint(tmp_path, 7, ddp, opt, sched, extra=extra)
    assert json.loads((path / "complete").read_text())["contents"]["optimizer_state"] == "empty"
    _train_step(ddp, opt, sched, 1)
    step, got = load_checkpoint(tmp_path, ddp, opt, sched)
    assert (step, got) == (7, extra)
    assert len(opt.state) == 0 and sched.num_steps == 0
    assert _train_step(ddp, opt, sched, 1)["lr"] == 2e-4  # init_lr: the warm-up restarts
    with pytest.raises(TypeError):  # checked on rank 0 before anything is written
        save_checkpoint(tmp_path, 8, ddp, opt, sched, extra={"bad": {1, 2}})
    assert not list(tmp_path.glob("step_00000008*"))


def test_mismatched_model_fails_naming_checkpoint_and_tensor(single_rank, tmp_path):
    from megatron_rl.training.checkpoint import CheckpointMismatchError, load_checkpoint, save_checkpoint

    ddp, opt, sched = _build(hidden=64)
    path = save_checkpoint(tmp_path, 1, ddp, opt, sched)
    wider, wider_opt, _ = _build(hidden=128)
    before = {n: p.detach().clone() for n, p in wider[0].named_parameters()}
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(tmp_path, wider, wider_opt)
    message = str(err.value)
    assert str(path) in message and "has shape" in message
    assert "'embedding.word_embeddings.weight' has shape (1024, 64)" in message
    assert "expects (1024, 128)" in message
    # Nothing was loaded.
    assert all(torch.equal(p, before[n]) for n, p in wider[0].named_parameters())


def test_missing_tensor_is_an_error_unless_not_strict(single_rank, tmp_path):
    from megatron_rl.training.checkpoint import CheckpointMismatchError, load_checkpoint, save_checkpoint

    tied, _, _ = _build(tied=True)  # no output_layer.weight: the embedding is reused
    save_checkpoint(tmp_path, 1, tied, None, None)
    untied, untied_opt, _untied_sched = _build()
    with pytest.raises(CheckpointMismatchError, match="output_layer.weight"):
        load_checkpoint(tmp_path, untied)
    model = untied[0].module
    kept = model.output_layer.weight.detach().clone()
    assert load_checkpoint(tmp_path, untied, strict=False) == (1, {})
    assert torch.equal(model.output_layer.weight, kept)
    assert torch.equal(
        model.embedding.word_embeddings.weight, tied[0].module.embedding.word_embeddings.weight
    )
    from megatron_rl.training.checkpoint_manifest import CheckpointError

    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(tmp_path, untied, untied_opt, strict=False)


def test_distributed_optimizer_saves_but_refuses_to_resume_on_cpu(single_rank, tmp_path):
    from megatron_rl.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.training.checkpoint_manifest import CheckpointError

    if torch.cuda.is_available():
        pytest.skip("the refusal is CPU-only")
    ddp, opt, sched = _build(distributed_optimizer=True)
    _train_step(ddp, opt, sched, 1)
    path = save_checkpoint(tmp_path, 1, ddp, opt, sched)
    contents = json.loads((path / "complete").read_text())["contents"]
    assert (contents["optimizer"], contents["optimizer_sharding"]) == ("distributed", "dp_reshardable")
    with pytest.raises(CheckpointError, match="distributed optimizer does not resume on CPU"):
        load_checkpoint(path, ddp, opt, sched)
    plain, plain_opt, _ = _build()
    with pytest.raises(CheckpointError, match="formats differ"):
        load_checkpoint(path, plain, plain_opt)
    assert load_checkpoint(path, plain)[0] == 1  # the weights load without the optimizer
    for got, want in zip(plain[0].module.parameters(), ddp[0].module.parameters()):
        assert torch.equal(got, want)
