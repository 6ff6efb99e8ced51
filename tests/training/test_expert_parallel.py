"""Expert parallelism (EP) for the MoE family on CPU: a tiny Qwen3-MoE (4 experts, top 2, two
layers) at EP=2, TP=1 over two gloo ranks against the same weights at EP=1.

One spawn of 2 ranks runs every layout in turn (each process start costs seconds):

1. EP=1 (DP=2, both ranks the same model): save a checkpoint; record the logits of a fixed
   batch, the HF-named tensors gathered on rank 0, and the loss and grad norm of one Adam step
   through Megatron's DDP (each rank its half of the batch) and the HF tensors after it.
2. EP=2: load that checkpoint (each rank keeps two of the four experts); logits, the HF gather
   (bitwise), then save an EP=2 checkpoint and take the same step: loss, grad norm, new weights.
3. EP=1 again: load the EP=2 checkpoint; the HF gather must equal step 1's bitwise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.spawn import run_ranks

BATCH, SEQ, VOCAB = 4, 8, 128
# fp32 sums reordered by the expert split (the token all-gather, per-expert reductions): ~1e-7
# of the scale here; a wrong expert, a missing reduction or a wrong scaling is O(1).
REL_TOL = 1e-5


def _hf_config():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _positions(batch: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(batch, SEQ)


def _hf_tensors(model) -> dict[str, torch.Tensor]:
    """The HF-named gather (rank 0 gets every tensor; the EP peer takes part and gets none)."""
    from megatron_rl.hf.layout import HFConverter
    from megatron_rl.training.chunks import iter_model_hf

    return {n: t.clone() for n, t in iter_model_hf([model], HFConverter.for_config(_hf_config()))}


def _adam_step(model) -> dict:
    """One Adam step on L = sum(logits^2) / (BATCH * SEQ), each DP rank its half of the batch;
    the loss, the grad norm and the HF tensors after the step."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.training.parallel import process_groups

    pgs = process_groups()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    opt = get_megatron_optimizer(
        # lr = eps = 1: the first step moves a weight by g / (|g| + 1), about g for small
        # gradients, so an error in any gradient shows at its own size (with a small eps the
        # step is lr * sign(g), which magnifies the rounding of near-zero gradients).
        OptimizerConfig(
            optimizer="adam",
            lr=1.0,
            adam_eps=1.0,
            weight_decay=0.0,
            clip_grad=1e6,
            use_distributed_optimizer=False,
        ),
        [ddp],
    )
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ids = _input_ids().chunk(pgs.dp.size())[pgs.dp.rank()]
    logits = ddp(ids, _positions(ids.shape[0]), None)
    loss = (logits.float() ** 2).sum() / (BATCH * SEQ)
    (loss * pgs.dp.size()).backward()  # DDP averages over DP: the gradient is that of L
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"loss": total.item(), "grad_norm": float(grad_norm), "after": _hf_tensors(model)}


def _ranks(rank: int, world: int, ckpt_ep1: str, ckpt_ep2: str) -> dict:
    from megatron_rl.training.model import build_gpt_model, load_model_checkpoint, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, parallel_layout

    out: dict = {}
    with parallel_layout(ParallelConfig(), seed=1):
        model = build_gpt_model(_hf_config(), ParallelConfig())
        save_model_checkpoint(model, ckpt_ep1)
        with torch.no_grad():
            out["ref_logits"] = model(_input_ids(), _positions(BATCH), None)
        out["ref_hf"] = _hf_tensors(model)
        out["ref_step"] = _adam_step(model)
    ep2 = ParallelConfig(expert_parallel=2)
    with parallel_layout(ep2, seed=2):  # another seed: only the checkpoint can make them equal
        model = build_gpt_model(_hf_config(), ep2)
        out["local_experts"] = sorted(
            n for n, _ in model.named_parameters() if ".local_experts." in n and "layers.0." in n
        )
        load_model_checkpoint(model, ckpt_ep1)
        with torch.no_grad():
            out["ep2_logits"] = model(_input_ids(), _positions(BATCH), None)
        out["ep2_hf"] = _hf_tensors(model)
        save_model_checkpoint(model, ckpt_ep2)
        out["ep2_step"] = _adam_step(model)
    with parallel_layout(ParallelConfig(), seed=3):
        model = build_gpt_model(_hf_config(), ParallelConfig())
        load_model_checkpoint(model, ckpt_ep2)
        out["back_hf"] = _hf_tensors(model)
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= REL_TOL * b.abs().max().item()


@pytest.mark.distributed
def test_expert_parallel_matches_one_expert_rank():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(
            _ranks, world_size=2, args=(str(Path(tmp) / "ep1"), str(Path(tmp) / "ep2")), timeout=300
        )
    r0, r1 = results
    # Each EP rank holds two of the four experts of every layer, as local experts 0 and 1.
    assert len(r0["local_experts"]) == 4 and r0["local_experts"] == r1["local_experts"]
    for r in results:  # (a) the same logits on every rank
        assert _close(r["ep2_logits"], r["ref_logits"])
    # (c) rank 0 gathers every expert, bitwise; the EP peer gets nothing.
    ref = r0["ref_hf"]
    assert sum(".mlp.experts." in n for n in ref) == 2 * 4 * 3  # layers x experts x projections
    assert r0["ep2_hf"].keys() == ref.keys() and r1["ep2_hf"] == {}
    assert all(torch.equal(r0["ep2_hf"][n], ref[n]) for n in ref)
    # (b) one Adam step: the same loss, grad norm and updated weights.
    a, b = r0["ep2_step"], r0["ref_step"]
    assert a["loss"] == pytest.approx(b["loss"], rel=REL_TOL)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=REL_TOL)
    assert r1["ep2_step"]["loss"] == a["loss"] and r1["ep2_step"]["grad_norm"] == pytest.approx(
        a["grad_norm"]
    )
    assert a["after"].keys() == ref.keys()
    moved = [n for n in ref if not torch.equal(b["after"][n], ref[n])]
    assert any(".mlp.experts." in n for n in moved)
    bad = [n for n in ref if not _close(a["after"][n], b["after"][n])]
    assert not bad, bad
    # (d) an EP=2 checkpoint loads at EP=1 bitwise.
    assert r0["back_hf"].keys() == ref.keys()
    assert all(torch.equal(r0["back_hf"][n], ref[n]) for n in ref)


def test_dense_model_refuses_expert_parallel():
    import transformers

    from megatron_rl.training.model import transformer_config_from_hf
    from megatron_rl.training.parallel import ParallelConfig

    dense = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ValueError, match="^expert_parallel: 2 needs an MoE model"):
        transformer_config_from_hf(dense, ParallelConfig(expert_parallel=2))


def test_expert_parallel_must_divide_the_experts():
    from megatron_rl.training.model import transformer_config_from_hf
    from megatron_rl.training.parallel import ParallelConfig

    with pytest.raises(ValueError, match="^expert_parallel: 3 does not divide num_experts=4"):
        transformer_config_from_hf(_hf_config(), ParallelConfig(expert_parallel=3))


def test_expert_parallel_is_checked_and_read_from_a_recipe(tmp_path):
    from megatron_rl.config import ConfigError, ConfigFieldError, load_dataclass
    from megatron_rl.training.config import TrainerConfig
    from megatron_rl.training.parallel import ParallelConfig

    with pytest.raises(ConfigFieldError) as err:
        ParallelConfig(expert_parallel=0)
    assert err.value.field == "expert_parallel"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("parallel:\n  tensor_parallel: 1\n  expert_parallel: 2\n")
    assert load_dataclass(TrainerConfig, recipe).parallel.expert_parallel == 2
    recipe.write_text("parallel:\n  expert_parallel: -1\n")
    with pytest.raises(ConfigError, match="expert_parallel"):
        load_dataclass(TrainerConfig, recipe)


def test_world_size_must_fit_expert_parallel():
    import torch.distributed as dist

    from megatron_rl.config import ConfigFieldError
    from megatron_rl.training.parallel import ParallelConfig, init_parallel

    owned = not dist.is_initialized()
    try:
        with pytest.raises(ConfigFieldError, match="does not divide the data-parallel size 1"):
            init_parallel(ParallelConfig(expert_parallel=2), seed=0)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
