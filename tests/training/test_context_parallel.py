"""Context parallelism is exact: the trainer at CP=2 (alone, x TP=2, x PP=2) and CP=4 gives the
loss, metrics, per-token log-probs and gradients of CP=1 on packed micro-batches of sequences of
very different lengths (fp32, real gloo groups, the CPU zig-zag attention); a checkpoint written
at CP=2 loads at CP=1 and the other way; the zig-zag split itself, and the refusals.

One spawn of 4 ranks runs the layouts (each process start costs seconds): the reference is the
trainer at CP=1 (TP=1, DP=4) from a saved checkpoint; each layout loads the same checkpoint."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.spawn import run_ranks
from tests.training.compare import diff_failures
from tests.training.test_layouts import _global_names, _max_diff, _shard

VOCAB = 1000
# The bound: 1e-6 of each tensor's scale (fp32; the attention's log-sum-exp merge and the
# gradient sums over ranks reorder float additions, ~1e-7).
REL_TOL = 1e-6
# With TP=2 the split matmuls reorder sums on their own: test_layouts.py measures TP alone at up to
# ~1.3e-6 of a tensor's scale (measured here: cp2_tp2's worst against TP 1, 1.3e-6 on layer 0's
# linear_proj; against TP 2 without CP, cp2_tp2_vs_tp2, 1.05e-6 on the same tensor).
TP_REL_TOL = 1.5e-6
CP4_REL_TOL = 2e-6  # the attention op alone over four CP ranks (test_zigzag_attention_...)
PACKED = dict(token_budget=160, layout="packed")  # per rank: CP=2 plans micro-batches of 320

LAYOUTS = (
    # name, tensor, pipeline, context
    ("cp2_dp2", 1, 1, 2),
    ("cp2_tp2", 2, 1, 2),
    ("cp2_pp2", 1, 2, 2),
    ("cp4", 1, 1, 4),
)


def _hf_config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )


# Completion lengths of very different sizes (prompts of 3..8 tokens): a 1-token tail next to a
# 150-token trace, so segments round up to 2 x CP differently and chunks are uneven in content.
LENGTHS = ((3, 150, 17), (90, 2, 41), (1, 64, 7), (120, 33, 5))


def _batch(seed: int = 0):
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi, lengths in enumerate(LENGTHS):
        p = int(torch.randint(3, 9, (1,), generator=g))
        prompt = Prompt(prompt_id=f"p{gi}", token_ids=torch.randint(0, VOCAB, (p,), generator=g).tolist())
        scored = [
            ScoredCompletion(
                completion=Completion(
                    prompt_id=prompt.prompt_id,
                    sample_index=k,
                    token_ids=torch.randint(0, VOCAB, (c,), generator=g).tolist(),
                    logprobs=(-math.log(VOCAB) + 0.3 * torch.randn(c, generator=g)).tolist(),
                    versions=[0] * c,
                ),
                reward=float(torch.rand(1, generator=g)),
            )
            for k, c in enumerate(lengths)
        ]
        groups.append(Group(prompt=prompt, completions=scored))
    return build_train_batch(groups, GRPOConfig())


def _trainer(tp: int, pp: int, cp: int, ckpt: str):
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import TrainerConfig
    from megatron_rl.training.model import load_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.trainer import PolicyTrainer

    cfg = TrainerConfig(
        parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp)
    )
    trainer = PolicyTrainer(_hf_config(), cfg, GRPOConfig(), BatchingConfig(**PACKED))
    load_model_checkpoint(trainer.model, ckpt)
    trainer.optimizer.reload_model_params()
    return trainer


def _measure(trainer) -> dict:
    batch = _batch()
    metrics = trainer.forward_backward(batch, "grpo")
    grads = {
        (ci, n): p.main_grad.clone()
        for ci, chunk in enumerate(trainer.chunks)
        for n, p in chunk.named_parameters()
    }
    return {"metrics": metrics, "grads": grads, "logprobs": trainer.compute_logprobs(batch)}


def _layouts(rank: int, world_size: int, root: str) -> list[dict]:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_rl.training.model import build_gpt_model, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, parallel_layout

    ckpt = f"{root}/init"
    with parallel_layout(ParallelConfig(), seed=1234):
        save_model_checkpoint(build_gpt_model(_hf_config(), ParallelConfig()), ckpt)  # collective
        ref_trainer = _trainer(1, 1, 1, ckpt)
        ref = _measure(ref_trainer)
        ref_names = _global_names(ref_trainer.chunks[0], False)
        ref_grads = {ref_names[n]: g for (_, n), g in ref["grads"].items()}
        ref_trainer.close()
    # The same TP without CP: what CP itself changes at TP 2 (TP's own reordering left out).
    with parallel_layout(ParallelConfig(tensor_parallel=2), seed=1234):
        tp_trainer = _trainer(2, 1, 1, ckpt)
        ref_tp2 = _measure(tp_trainer)
        tp_rank = tp_trainer.pgs.tp.rank()
        tp_trainer.close()
    results = []
    for name, tp, pp, cp in LAYOUTS:
        with parallel_layout(
            ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp), seed=1234
        ):
            trainer = _trainer(tp, pp, cp, ckpt)
            assert trainer.pgs.cp.size() == cp
            got = _measure(trainer)
            diffs = {}
            for k, v in ref["metrics"].items():
                if k in ("step_time_s", "tokens_per_s", "microbatches", "padding_fraction"):
                    continue
                diffs[f"metric {k}"] = (abs(got["metrics"][k] - v), max(abs(v), 1.0))
            names = [_global_names(c, False) for c in trainer.model]
            for (ci, local), g in got["grads"].items():
                p = dict(trainer.chunks[ci].named_parameters())[local]
                full = ref_grads[names[ci][local]]
                diffs[f"grad {names[ci][local]}"] = _max_diff(
                    g, _shard(p, local, full, trainer.pgs.tp.rank(), tp)
                )
            for i, (a, b) in enumerate(zip(got["logprobs"], ref["logprobs"], strict=True)):
                diffs[f"logprobs {i}"] = _max_diff(a, b)
            results.append({"layout": name, "diffs": diffs})
            if name == "cp2_tp2":  # the same global rank holds the same TP shard in both layouts
                assert trainer.pgs.tp.rank() == tp_rank
                same_tp = {f"grad {k}": _max_diff(g, ref_tp2["grads"][k]) for k, g in got["grads"].items()}
                same_tp.update(
                    {
                        f"logprobs {i}": _max_diff(a, b)
                        for i, (a, b) in enumerate(zip(got["logprobs"], ref_tp2["logprobs"]))
                    }
                )
                same_tp["loss"] = (
                    abs(got["metrics"]["loss"] - ref_tp2["metrics"]["loss"]),
                    abs(ref_tp2["metrics"]["loss"]),
                )
                results.append({"layout": "cp2_tp2_vs_tp2", "diffs": same_tp})
            trainer.close()
    return results


@pytest.mark.distributed
def test_context_parallel_equals_cp1_at_every_layout():
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_layouts, 4, args=(root,), timeout=300)
    bad, compared = diff_failures(per_rank, lambda what, scale: REL_TOL * max(scale, 1e-6))
    bad = [b for b in bad if "_tp2" not in b.split(":")[0]]  # judged below at TP's own bound
    with_tp = [[r for r in rank if "_tp2" in r["layout"]] for rank in per_rank]
    bad += diff_failures(with_tp, lambda what, scale: TP_REL_TOL * max(scale, 1e-6))[0]
    assert not bad, "\n".join(bad)
    assert set(compared) == {layout[0] for layout in LAYOUTS} | {"cp2_tp2_vs_tp2"}, compared


def _checkpoints(rank: int, world_size: int, root: str) -> dict:
    """Save at one CP, load at the other: the same weights and optimizer step."""
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_rl.training.model import build_gpt_model, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig, parallel_layout

    ckpt = f"{root}/init"
    out = {}
    with parallel_layout(ParallelConfig(), seed=1234):
        save_model_checkpoint(build_gpt_model(_hf_config(), ParallelConfig()), ckpt)  # collective
    for write_cp, read_cp in ((2, 1), (1, 2)):
        with parallel_layout(ParallelConfig(context_parallel=write_cp), seed=1234):
            trainer = _trainer(1, 1, write_cp, ckpt)
            trainer.rl_step(_batch())  # one step: weights and Adam state move
            saved = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters()}
            trainer.save_checkpoint(f"{root}/cp{write_cp}")
            trainer.close()
        with parallel_layout(ParallelConfig(context_parallel=read_cp), seed=1234):
            trainer = _trainer(1, 1, read_cp, ckpt)  # the initial weights, then the checkpoint
            trainer.load_checkpoint(f"{root}/cp{write_cp}")
            loaded = {n: p.detach() for n, p in trainer.chunks[0].named_parameters()}
            out[f"{write_cp}->{read_cp}"] = {
                "step": trainer.step,
                "equal": all(torch.equal(saved[n], loaded[n]) for n in saved),
            }
            trainer.close()
    return out


@pytest.mark.distributed
def test_a_checkpoint_written_at_cp2_loads_at_cp1_and_back():
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_checkpoints, 2, args=(root,), timeout=300)
    for got in per_rank:
        assert got == {"2->1": {"step": 1, "equal": True}, "1->2": {"step": 1, "equal": True}}


# -- the split itself (one process) -----------------------------------------------------------------


def test_zigzag_split_gives_each_rank_two_balanced_chunks_and_puts_values_back():
    from megatron_rl.batching.collate import build_microbatches, split_for_context_parallel
    from megatron_rl.types import TrainBatch

    batch = _batch()
    size = 2
    (mb,) = build_microbatches(batch, 4096, layout="packed", segment_multiple=2 * size)
    bounds = mb.packed_cu_seqlens().tolist()
    assert all(b % (2 * size) == 0 for b in bounds) and bounds[-1] == mb.tokens.shape[1]
    parts = [split_for_context_parallel(mb, size, r) for r in range(size)]
    # every position exactly once over the ranks, each rank half of every segment
    seen = torch.cat([p.cp_index for p in parts]).sort().values
    assert torch.equal(seen, torch.arange(mb.tokens.shape[1]))
    for r, p in enumerate(parts):
        assert p.tokens.shape[1] == mb.tokens.shape[1] // size
        assert torch.equal(p.tokens[0], mb.tokens[0, p.cp_index])
        assert p.cu_seqlens is mb.cu_seqlens  # the whole sequences' bounds, as RoPE takes them
        lo, hi = bounds[0], bounds[1]
        c = (hi - lo) // (2 * size)
        assert p.cp_index[:c].tolist() == list(range(lo + r * c, lo + (r + 1) * c))
        assert p.cp_index[c : 2 * c].tolist() == list(range(lo + (3 - r) * c, lo + (4 - r) * c))
    # loss weights and masks split with the tokens: the total is the whole micro-batch's
    assert sum(float(p.loss_weights.sum()) for p in parts) == pytest.approx(float(mb.loss_weights.sum()))
    # per-sequence values assembled from the ranks' shares equal the whole micro-batch's
    values = torch.randn(mb.tokens.shape)
    whole = mb.split_per_sequence(values)
    shares = [p.split_per_sequence(values[:, p.cp_index]) for p in parts]
    for i, w in enumerate(whole):
        assert torch.equal(shares[0][i] + shares[1][i], w)
    assert len(whole) == len(TrainBatch(sequences=batch.sequences))


def test_context_parallel_refusals_name_the_field():
    from megatron_rl.batching.collate import collate, split_for_context_parallel
    from megatron_rl.config import ConfigFieldError
    from megatron_rl.orchestration.recipe import load_config
    from megatron_rl.training.parallel import ParallelConfig

    with pytest.raises(ConfigFieldError) as err:
        ParallelConfig(context_parallel=0)
    assert err.value.field == "context_parallel"
    assert ParallelConfig(tensor_parallel=2, pipeline_parallel=2, context_parallel=2).replica_size == 8
    with pytest.raises(Exception, match="batching.layout.*context_parallel 2 splits packed rows only"):
        load_config(None, ["trainer.parallel.context_parallel=2", "batching.layout=padded"])
    seq = next(s for s in _batch().sequences if s.length % 4)
    with pytest.raises(ValueError, match="multiple of 4 tokens"):
        split_for_context_parallel(collate([seq], [0], layout="packed", pad_to_multiple=1), 2, 0)
    with pytest.raises(ValueError, match="packed rows only"):
        collate([seq], [0], layout="padded", segment_multiple=4)


def _attention(rank: int, world_size: int) -> dict:
    """The zig-zag attention of ``world_size`` ranks against ``segment_causal_attention`` of the
    whole row: outputs and query / key / value gradients (GQA: 4 heads, 2 groups)."""
    from megatron_rl.training.attention import _ZigzagAttention, segment_causal_attention, zigzag_chunks

    size = world_size
    g = torch.Generator().manual_seed(3)
    lengths = [4 * size * k for k in (1, 7, 2, 30)]  # segments, each a multiple of 2 * size
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    t = bounds[-1]
    q, k, v = (
        torch.randn(t, 4, 8, generator=g),
        torch.randn(t, 2, 8, generator=g),
        torch.randn(t, 2, 8, generator=g),
    )
    grad = torch.randn(t, 4, 8, generator=g)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = segment_causal_attention(*whole, bounds, 0.3)
    out.backward(grad)
    index = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        c = (hi - lo) // (2 * size)
        for m in zigzag_chunks(size, rank):
            index += range(lo + m * c, lo + (m + 1) * c)
    idx = torch.tensor(index)
    mine = [x[idx].clone().requires_grad_() for x in (q, k, v)]
    local = [b // size for b in bounds]
    got = _ZigzagAttention.apply(*mine, local, torch.distributed.group.WORLD, 0.3)
    got.backward(grad[idx])
    return {
        "out": _max_diff(got.detach(), out.detach()[idx]),
        **{f"grad {n}": _max_diff(a.grad, b.grad[idx]) for n, a, b in zip("qkv", mine, whole)},
    }


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 4])
def test_zigzag_attention_equals_whole_sequence_attention(size):
    per_rank = run_ranks(_attention, size, timeout=120)
    # Four ranks merge four partial log-sum-exps and add K/V gradient parts in yet another order:
    # measured 1.46e-6 of the scale on grad v (a 2-core x86 machine, torch 2.13 CPU); two ranks
    # stay within REL_TOL.
    tol = REL_TOL if size == 2 else CP4_REL_TOL
    for rank, diffs in enumerate(per_rank):
        for what, (err, scale) in diffs.items():
            assert err <= tol * scale, f"rank {rank} {what}: {err:.3g} (scale {scale:.3g})"
