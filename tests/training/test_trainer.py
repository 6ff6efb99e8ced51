"""The trainer's GRPO loss, SFT loss, gradients, metrics and log-probs at every layout equal the pure
functions of ``megatron_rl.algorithms`` applied to one sequence at a time on a single process.

One spawn of 4 gloo ranks runs everything (each process start costs seconds):

1. Reference, TP=1 (every rank the same): a plain ``GPTModel``, saved with
   ``save_model_checkpoint``. For each sequence alone: full logits, padded vocabulary (ids >= 1000)
   dropped (= masked to -inf), ``naive_token_logprobs`` (a full fp32 log-softmax), then ``grpo_loss`` /
   ``-sum w logp``; the minibatch loss is the sum over sequences, backpropagated for the
   reference gradients. Nothing here goes through Megatron's schedule, microbatches or DDP.
2. Each layout builds a :class:`PolicyTrainer`, loads that checkpoint and runs
   ``forward_backward`` (packed rows at one token budget, padded rows at another: the same
   numbers), SFT, ``compute_logprobs``, and compares against the reference:
   - ``dp4``: TP1 x DP4; also a 3-sequence minibatch, where one DP rank gets no sequence and
     must still join the gradient all-reduce.
   - ``tp2_dp2_distopt``: the distributed optimizer; gradients are checked through one
     ``rl_step`` (grad norm and the parameters after Adam's first step).
   - ``pp2_vpp2_dp2_tied``: interleaved pipeline with tied embeddings (both copies' gradients),
     with enough microbatches (4) to reach the 1F1B steady state, where PP=2 needs the trainer's
     unbatched p2p (see ``PolicyTrainer._build_model``).
   - ``tp2_pp2``: TP2 x PP2.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.spawn import run_ranks
from tests.training.compare import diff_failures
from tests.training.test_layouts import _global_names, _max_diff, _shard

VOCAB = 1000  # real vocabulary; the model pads to 1024 (ids 1000..1023 on the last TP shard)
# Per tensor: max |trainer - reference| <= REL_TOL * max |reference| (test_layouts.py's bound;
# reordered fp32 sums and the RoPE offset inside packed rows stay around 1e-6).
REL_TOL = 1e-5
EPS_LOW, EPS_HIGH = 0.2, 0.28
PACKED = dict(token_budget=48, layout="packed")
PADDED = dict(token_budget=64, layout="padded", strategy="uniform")

LAYOUTS = (
    # name, tensor, pipeline, virtual, tied, distributed optimizer
    ("dp4", 1, 1, None, False, False),
    ("tp2_dp2_distopt", 2, 1, None, False, True),
    ("pp2_vpp2_dp2_tied", 1, 2, 2, True, False),
    ("tp2_pp2", 2, 2, None, False, False),
)


def _hf_config(tied: bool):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )


def _grpo_batch(n_groups: int = 4, group_size: int = 3, seed: int = 0):
    """Groups of random prompts/completions with spread rewards -> ``build_train_batch``.
    Behaviour log-probs sit near the random model's (~ -ln 1000) with noise, so some ratios clip."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = Prompt(
            prompt_id=f"p{gi}",
            token_ids=torch.randint(
                0, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g
            ).tolist(),
        )
        scored = []
        for k in range(group_size):
            c = int(torch.randint(2, 15, (1,), generator=g))
            comp = Completion(
                prompt_id=prompt.prompt_id,
                sample_index=k,
                token_ids=torch.randint(0, VOCAB, (c,), generator=g).tolist(),
                logprobs=(-math.log(VOCAB) + 0.3 * torch.randn(c, generator=g)).tolist(),
                versions=[0] * c,
            )
            scored.append(ScoredCompletion(completion=comp, reward=float(torch.rand(1, generator=g))))
        groups.append(Group(prompt=prompt, completions=scored))
    return build_train_batch(groups, GRPOConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH))


def _sft_batch(seed: int = 1):
    from megatron_rl.batching.sft import build_sft_batch

    g = torch.Generator().manual_seed(seed)
    pairs = [
        (
            torch.randint(0, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist(),
            torch.randint(0, VOCAB, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist(),
        )
        for _ in range(7)
    ]
    return build_sft_batch(pairs)


def _sequence_terms(model, seq):
    """Reference pieces for one sequence: completion log-probs (differentiable) and entropy."""
    from megatron_rl.algorithms.logprobs import naive_token_logprobs

    n, p = seq.length, seq.prompt_length
    logits = model(seq.tokens[None], torch.arange(n)[None], None)[0].float()  # [n, 1024]
    # Dropping the padded ids (1000..1023) is masking them to -inf, without 0 * -inf in the entropy.
    return naive_token_logprobs(logits[p - 1 : n - 1, :VOCAB], seq.tokens[p:])


def _reference_grpo(model, batch) -> dict:
    from megatron_rl.algorithms.loss import finalize_loss_metrics, grpo_loss, reduce_loss_metrics

    model.zero_grad(set_to_none=True)
    total, parts, logps = 0.0, [], []
    for s in batch.sequences:
        logp, entropy = _sequence_terms(model, s)
        c = s.completion_length
        loss, metrics = grpo_loss(
            logp,
            s.behaviour_logprobs,
            torch.full((c,), s.advantage),
            torch.full((c,), s.weight),
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            entropy=entropy,
        )
        total = total + loss
        parts.append(metrics)
        logps.append(logp.detach().clone())
    total.backward()
    return {
        "loss": total.item(),
        "metrics": finalize_loss_metrics(reduce_loss_metrics(parts)),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "logprobs": logps,
    }


def _reference_sft(model, batch) -> dict:
    model.zero_grad(set_to_none=True)
    total = sum(-(s.weight * _sequence_terms(model, s)[0]).sum() for s in batch.sequences)
    total.backward()
    return {"loss": total.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _references(ckpt_root: str) -> dict:
    from megatron_rl.training.model import build_gpt_model, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig

    refs = {}
    for tied in (False, True):
        model = build_gpt_model(_hf_config(tied), ParallelConfig())
        save_model_checkpoint(model, f"{ckpt_root}/{tied}")
        refs[tied] = {
            "grpo": _reference_grpo(model, _grpo_batch()),
            "small": _reference_grpo(model, _grpo_batch(n_groups=1, seed=5)),
            "sft": _reference_sft(model, _sft_batch()),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "num_parameters": sum(p.numel() for p in model.parameters()),
        }
    return refs


def _scalar(what: str, value: float, ref: float, floor: float = 0.0) -> dict:
    """(error, scale) of a number; ``floor`` bounds the scale of a metric that is a mean of O(1)
    terms and may cancel to near 0 (advantage_mean: fp32 sums in another order differ ~1e-7)."""
    return {what: (abs(value - ref), max(abs(ref), floor))}


def _grads(trainer, names, ref_grads: dict, label: str) -> dict:
    tp, tp_rank = trainer.pgs.tp.size(), trainer.pgs.tp.rank()
    return {
        f"{label} {chunk_names[local]}": _max_diff(
            p.main_grad, _shard(p, local, ref_grads[chunk_names[local]], tp_rank, tp)
        )
        for chunk, chunk_names in zip(trainer.chunks, names)
        for local, p in chunk.named_parameters()
    }


def _grpo_checks(trainer, names, ref: dict, batch, label: str, check_grads: bool) -> dict:
    """Loss, every metric and (unless the distributed optimizer shards them) the gradients,
    for packed rows and for padded rows at another token budget."""
    from megatron_rl.batching.config import BatchingConfig

    diffs = {}
    for rows, b in (("packed", PACKED), ("padded", PADDED)):
        got = trainer.forward_backward(batch, "grpo", batching=BatchingConfig(**b))
        diffs.update(_scalar(f"{label} {rows} loss", got["loss"], ref["loss"]))
        for k, v in ref["metrics"].items():
            diffs.update(_scalar(f"{label} {rows} metric {k}", got[k], v, floor=1.0))
        if check_grads:
            diffs.update(_grads(trainer, names, ref["grads"], f"{label} {rows} grad"))
    return diffs


def _adam_step_checks(trainer, names, ref: dict) -> dict:
    """``rl_step`` with lr = adam_eps = 1: Adam's first step moves each parameter by
    ``g / (|g| + 1)``, so a wrong gradient shard shows at its own size (test_layouts.py)."""
    out = trainer.rl_step(_grpo_batch())
    g = ref["grpo"]["grads"]
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in g.values())).item()
    stepped = {n: p - g[n] / (g[n].abs() + 1.0) for n, p in ref["params"].items()}
    tp, tp_rank = trainer.pgs.tp.size(), trainer.pgs.tp.rank()
    diffs = {**_scalar("grad norm", out["grad_norm"], norm), **_scalar("lr", out["lr"], 1.0)}
    for chunk, chunk_names in zip(trainer.chunks, names):
        for local, p in chunk.named_parameters():
            ref_p = _shard(p, local, stepped[chunk_names[local]], tp_rank, tp)
            diffs[f"stepped {chunk_names[local]}"] = _max_diff(p.detach(), ref_p)
    return diffs


def _run_layout(layout: tuple, refs: dict, ckpt_root: str) -> dict:
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import OptimConfig, TrainerConfig
    from megatron_rl.training.model import load_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.trainer import PolicyTrainer

    name, tp, pp, vpp, tied, distopt = layout
    ref = refs[tied]
    cfg = TrainerConfig(
        parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp),
        optim=OptimConfig(lr=1.0, adam_eps=1.0, clip_grad=1e6),
        distributed_optimizer="on" if distopt else "off",
    )
    trainer = PolicyTrainer(
        _hf_config(tied), cfg, GRPOConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH), BatchingConfig(**PACKED)
    )
    load_model_checkpoint(trainer.model, f"{ckpt_root}/{tied}")
    trainer.optimizer.reload_model_params()
    names = [_global_names(c, tied) for c in trainer.model]
    diffs = _scalar("num_parameters", trainer.num_parameters(), ref["num_parameters"])
    diffs.update(_grpo_checks(trainer, names, ref["grpo"], _grpo_batch(), "grpo", not distopt))
    sft = trainer.forward_backward(_sft_batch(), "sft")
    diffs.update(_scalar("sft loss", sft["loss"], ref["sft"]["loss"]))
    if not distopt:
        diffs.update(_grads(trainer, names, ref["sft"]["grads"], "sft grad"))
    for i, (got, want) in enumerate(
        zip(trainer.compute_logprobs(_grpo_batch()), ref["grpo"]["logprobs"], strict=True)
    ):
        diffs[f"logprobs {i}"] = _max_diff(got, want)
    if name == "dp4":  # 3 sequences over 4 replicas: one replica runs only a filler microbatch
        diffs.update(
            _grpo_checks(trainer, names, ref["small"], _grpo_batch(n_groups=1, seed=5), "small", True)
        )
    if distopt:
        diffs.update(_adam_step_checks(trainer, names, ref))
    return {"layout": name, "diffs": diffs}


def _all_layouts(rank: int, world_size: int, ckpt_root: str) -> list[dict]:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU test by design, also where a GPU is present
    from megatron_rl.training.parallel import ParallelConfig, parallel_layout

    with parallel_layout(ParallelConfig(), seed=1234):
        refs = _references(ckpt_root)
    results = []
    for layout in LAYOUTS:
        cfg = ParallelConfig(
            tensor_parallel=layout[1], pipeline_parallel=layout[2], virtual_pipeline=layout[3]
        )
        with parallel_layout(cfg, seed=1234):
            results.append(_run_layout(layout, refs, ckpt_root))
    return results


@pytest.mark.distributed
def test_trainer_matches_single_sequence_reference_at_every_layout():
    with tempfile.TemporaryDirectory() as ckpt_root:
        per_rank = run_ranks(_all_layouts, 4, args=(ckpt_root,), timeout=240)
    bad, compared = diff_failures(per_rank, lambda what, scale: REL_TOL * max(scale, 1e-6))
    assert not bad, "\n".join(bad)
    assert set(compared) == {layout[0] for layout in LAYOUTS}, compared
    assert all(n >= 4 * 40 for n in compared.values()), compared


@pytest.mark.distributed
def test_bench_train_step_runs_both_layouts_from_the_same_weights():
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, also where a GPU is present
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "bench",
            "train-step",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "1000",
            "--sequences",
            "8",
            "--warmup",
            "1",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env=env,
    )
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "TP=2 / TP=1 step time" in proc.stdout
    assert figures["tokens_per_s"] > 0 and figures["tp2_over_tp1_step_time"] > 0
    # The plain PyTorch/HF baseline starts from the trainer's weights: the same first step.
    assert figures["plain_torch_tokens_per_s"] > 0 and figures["trainer_over_plain_torch"] > 0
    assert figures["plain_torch_first_step_match"] is True
    # CPU initialisation does not depend on TP: the two layouts' first steps are the same step.
    assert figures["tp1_tp2_first_step_match"] is True
