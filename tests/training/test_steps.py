"""Forward steps, loss closures, the SFT batch builder, the trainer config and a single-process
trainer: packed and padded rows and every token budget give the same loss and gradients,
``compute_logprobs`` is ``token_logprobs`` of the full logits, and the LR schedule is the
configured one."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.algorithms.logprobs import naive_token_logprobs, token_logprobs
from megatron_rl.algorithms.loss import grpo_loss
from megatron_rl.batching.collate import collate
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.config import ConfigFieldError
from megatron_rl.training.config import OptimConfig, TrainerConfig
from megatron_rl.training.steps import (
    LogitPositions,
    StepContext,
    grpo_loss_fn,
    mask_padded_vocab,
    metric_keys,
    model_inputs,
    sft_loss_fn,
)
from megatron_rl.types import TrainBatch, TrainSequence
from tests.training.conftest import tiny_llama_config

VOCAB = 100  # padded to 1024 by the model


def _sequences(n: int, seed: int = 0, vocab: int = VOCAB) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        out.append(
            TrainSequence(
                tokens=torch.randint(0, vocab, (p + c,), generator=g),
                prompt_length=p,
                behaviour_logprobs=-math.log(vocab) + 0.3 * torch.randn(c, generator=g),
                versions=torch.zeros(c, dtype=torch.long),
                advantage=float(torch.randn(1, generator=g)),
                weight=float(torch.rand(1, generator=g)) / 10,
                group_id=i // 3,
            )
        )
    return out


# -- pure pieces ----------------------------------------------------------------------------------


def test_mask_padded_vocab_masks_only_ids_past_the_vocabulary():
    logits = torch.randn(2, 3, 8, requires_grad=True)
    masked = mask_padded_vocab(logits, 6)
    assert torch.isinf(masked[..., 6:]).all() and torch.equal(masked[..., :6], logits[..., :6])
    masked.exp().sum().backward()
    assert (logits.grad[..., 6:] == 0).all() and (logits.grad[..., :6] != 0).all()
    assert mask_padded_vocab(logits, 8) is logits  # nothing padded: no copy


def test_loss_closures_equal_the_pure_functions_on_real_vocabulary_logits():
    seqs = _sequences(3)
    mb = collate(seqs, [0, 1, 2], layout="padded")
    logits = torch.randn(*mb.tokens.shape, 128, requires_grad=True)  # 28 padded ids
    ctx = StepContext(tp_group=None, vocab_size=VOCAB, device=torch.device("cpu"), temperature=0.8)
    loss, n, metrics = grpo_loss_fn(ctx, mb, None, logits)
    want, want_metrics = 0.0, []
    for row, s in enumerate(seqs):
        p, c = s.prompt_length, s.completion_length
        logp, ent = naive_token_logprobs(
            logits[row, p - 1 : p + c - 1, :VOCAB], s.tokens[p:], temperature=0.8
        )
        part, m = grpo_loss(
            logp, s.behaviour_logprobs, torch.full((c,), s.advantage), torch.full((c,), s.weight), entropy=ent
        )
        want, want_metrics = want + part, want_metrics + [m]
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert int(n) == sum(s.completion_length for s in seqs) == metrics["tokens"]
    assert metrics["entropy_sum"].item() == pytest.approx(
        sum(m["entropy_sum"].item() for m in want_metrics), rel=1e-5
    )
    assert sorted(metrics) == metric_keys("grpo")
    sft, _, sft_metrics = sft_loss_fn(ctx, mb, None, logits)
    nll = -sum(
        naive_token_logprobs(
            logits[r, s.prompt_length - 1 : s.length - 1, :VOCAB], s.tokens[s.prompt_length :]
        )[0].sum()
        * s.weight
        for r, s in enumerate(seqs)
    )
    assert sft.item() == pytest.approx(nll.item(), rel=1e-5)  # SFT ignores the temperature
    assert sorted(sft_metrics) == metric_keys("sft") == ["entropy_sum", "loss", "nll_sum", "tokens"]


def test_closures_on_logits_at_loss_positions_equal_full_logits():
    """The output layer runs only at LogitPositions: the closures given those logits ``[1, N, V]``
    return the loss, metrics and gradient of the full ``[R, S, V]`` logits."""
    mb = collate(_sequences(4), [0, 1, 2, 3], layout="packed", pad_to_multiple=8)
    ctx = StepContext(tp_group=None, vocab_size=VOCAB, device=torch.device("cpu"), temperature=0.8)
    positions = LogitPositions.of(mb, ctx.device)
    assert len(positions.rows) == int(mb.loss_mask.sum()) < mb.tokens.numel()  # prompts skipped
    for fn in (grpo_loss_fn, sft_loss_fn):
        full = torch.randn(*mb.tokens.shape, 128, generator=torch.Generator().manual_seed(1))
        full.requires_grad_(True)
        picked = full.detach()[positions.rows, positions.cols].unsqueeze(0).requires_grad_(True)
        want, n_want, m_want = fn(ctx, mb, None, full.clone())
        got, n_got, m_got = fn(ctx, mb, positions, picked.clone())
        want.backward()
        got.backward()
        assert got.item() == pytest.approx(want.item(), rel=1e-6) and int(n_got) == int(n_want)
        assert all(m_got[k].item() == pytest.approx(m_want[k].item(), rel=1e-6) for k in m_want)
        torch.testing.assert_close(picked.grad[0], full.grad[positions.rows, positions.cols])
        outside = torch.ones(mb.tokens.shape, dtype=torch.bool)
        outside[positions.rows, positions.cols] = False
        assert (full.grad[outside] == 0).all()  # no loss reads another position's logits


def test_model_inputs_per_layout():
    seqs = _sequences(3)
    packed = collate(seqs, [0, 1, 2], layout="packed", pad_to_multiple=8)
    inputs = model_inputs(packed)
    assert inputs["attention_mask"] is None  # no dense [T, T] mask: the segments travel as cu_seqlens
    thd = inputs["packed_seq_params"]
    assert thd.qkv_format == "thd" and thd.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(thd.cu_seqlens_q, packed.cu_seqlens) and thd.cu_seqlens_kv is thd.cu_seqlens_q
    assert thd.max_seqlen_q == max(
        max(s.length for s in seqs), packed.tokens.shape[1] - sum(s.length for s in seqs)
    )
    padded = model_inputs(collate(seqs, [0, 1, 2], layout="padded"))
    assert padded["attention_mask"] is None and "packed_seq_params" not in padded


def test_build_sft_batch_weights_answer_tokens_only():
    batch = build_sft_batch([([1, 2, 3], [4, 5]), ([6], [7, 8, 9])])
    assert [s.weight for s in batch.sequences] == [0.2, 0.2]
    assert [s.prompt_length for s in batch.sequences] == [3, 1]
    mb = collate(batch.sequences, [0, 1], layout="packed")
    # Label positions of the 5 answer tokens carry 1/5 each; prompt positions carry nothing.
    assert mb.loss_weights.sum().item() == pytest.approx(1.0)
    assert mb.labels[mb.loss_weights != 0].tolist() == [4, 5, 7, 8, 9]
    with pytest.raises(ValueError, match="pair 1"):
        build_sft_batch([([1], [2]), ([3], [])])


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (OptimConfig, {"lr": 0.0}, "lr"),
        (OptimConfig, {"lr": 1e-6, "min_lr": 1e-5}, "min_lr"),
        (OptimConfig, {"clip_grad": 0.0}, "clip_grad"),
        (OptimConfig, {"adam_beta2": 1.0}, "adam_beta2"),
        (OptimConfig, {"decay_style": "linear", "warmup_steps": 5, "decay_steps": 5}, "decay_steps"),
        (OptimConfig, {"decay_style": "step"}, "decay_style"),
        (TrainerConfig, {"precision": "fp16"}, "precision"),
        (TrainerConfig, {"distributed_optimizer": "yes"}, "distributed_optimizer"),
    ],
)
def test_config_errors_name_the_field(cls, kwargs, field):
    with pytest.raises(ConfigFieldError) as err:
        cls(**kwargs)
    assert err.value.field == field


def test_auto_settings_resolve_for_this_machine():
    cfg = TrainerConfig()
    gpu = torch.cuda.is_available()
    assert cfg.params_dtype() == (torch.bfloat16 if gpu else torch.float32)
    assert cfg.use_distributed_optimizer() == gpu
    assert TrainerConfig(precision="fp32", distributed_optimizer="on").use_distributed_optimizer()


# -- a single-process trainer -----------------------------------------------------------------------


def _hf(tied: bool = False):
    return tiny_llama_config(VOCAB, 128, tied=tied)


def _trainer(optim: OptimConfig | None = None, tied: bool = False, recompute: bool = False):
    from megatron_rl.training.trainer import PolicyTrainer

    torch.manual_seed(0)  # CPU initialisation draws from the default generator: same weights
    return PolicyTrainer(
        _hf(tied),
        TrainerConfig(optim=optim or OptimConfig(), recompute=recompute),
        GRPOConfig(),
        BatchingConfig(token_budget=64),
    )


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for n, p in trainer.chunks[0].named_parameters()}


COLLATIONS = [
    dict(token_budget=64, layout="packed"),
    dict(token_budget=16, layout="packed", strategy="uniform"),
    dict(token_budget=40, layout="packed", pad_to_multiple=8),
    dict(token_budget=64, layout="padded"),
    dict(token_budget=13, layout="padded", strategy="uniform", pad_to_multiple=4),
]


@pytest.mark.parametrize("mode", ["grpo", "sft"])
def test_layouts_and_budgets_give_the_same_loss_and_gradients(single_rank, mode):
    trainer = _trainer()
    batch = TrainBatch(sequences=_sequences(10, seed=3))
    runs = []
    for c in COLLATIONS:
        metrics = trainer.forward_backward(batch, mode, batching=BatchingConfig(**c))
        runs.append((metrics, _grads(trainer)))
    (ref, ref_grads), counts = runs[0], {r[0]["microbatches"] for r in runs}
    assert len(counts) >= 3, counts  # the collations really differ
    for c, (metrics, grads) in zip(COLLATIONS[1:], runs[1:]):
        assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5), c
        assert metrics["tokens"] == ref["tokens"]
        for name, g in grads.items():
            scale = ref_grads[name].abs().max().item()
            assert scale > 0 and (g - ref_grads[name]).abs().max().item() <= 1e-5 * scale, (c, name)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_output_layer_runs_only_at_loss_positions(single_rank, monkeypatch, layout):
    """The trainer's output layer sees only the loss positions' hidden states, and the step's
    loss and gradients equal those of the full logits."""
    import dataclasses

    from megatron.core.utils import unwrap_model

    trainer = _trainer()
    batch = TrainBatch(sequences=_sequences(6, seed=5))
    cfg = BatchingConfig(token_budget=64, layout=layout)
    seen: list[int] = []
    layer = unwrap_model(trainer.chunks[0]).output_layer
    handle = layer.register_forward_hook(
        lambda m, args, out: seen.append(args[0].shape[0] * args[0].shape[1])
    )
    selected = trainer.forward_backward(batch, "grpo", batching=cfg)
    got_grads, n_selected = _grads(trainer), sum(seen)
    context = trainer._context
    monkeypatch.setattr(
        trainer, "_context", lambda t=None: dataclasses.replace(context(t), select_positions=False)
    )
    seen.clear()
    full = trainer.forward_backward(batch, "grpo", batching=cfg)
    handle.remove()
    assert n_selected == sum(s.completion_length for s in batch.sequences) < sum(seen)
    assert selected["loss"] == pytest.approx(full["loss"], rel=1e-6)
    assert selected["entropy_mean"] == pytest.approx(full["entropy_mean"], rel=1e-6)
    for name, g in _grads(trainer).items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(), msg=name)


def test_recompute_gives_the_same_loss_and_gradients(single_rank):
    batch = TrainBatch(sequences=_sequences(6, seed=5))
    runs = []
    for recompute in (False, True):
        trainer = _trainer(recompute=recompute)
        assert trainer.model[0].config.recompute_granularity == ("full" if recompute else None)
        runs.append((trainer.forward_backward(batch, "grpo")["loss"], _grads(trainer)))
    (loss, grads), (loss_rc, grads_rc) = runs
    assert loss_rc == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(grads_rc[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item())


def test_compute_logprobs_equals_token_logprobs_of_the_full_logits(single_rank):
    trainer = _trainer()
    seqs = _sequences(5, seed=4)
    model = trainer.chunks[0]
    for temperature in (1.0, 0.7):
        got = trainer.compute_logprobs(TrainBatch(sequences=seqs), temperature=temperature)
        for s, values in zip(seqs, got, strict=True):
            with torch.no_grad():
                logits = model(s.tokens[None], torch.arange(s.length)[None], None)[0]
            logits[:, VOCAB:] = -float("inf")  # the padded ids, as the generator never has them
            want, _ = token_logprobs(
                logits[s.prompt_length - 1 : -1], s.tokens[s.prompt_length :], temperature=temperature
            )
            assert values.shape == (s.completion_length,)
            torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)


def test_lr_schedule_empty_batch_and_parameter_count(single_rank):
    trainer = _trainer(
        OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=4, decay_style="linear"), tied=True
    )
    batch = build_sft_batch([([1, 2], [3, 4, 5])])
    lrs = [trainer.sft_step(batch)["lr"] for _ in range(5)]
    # Warm-up from step 1 (lr k/2), then linear to min_lr at step 4, min_lr after.
    assert lrs == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])
    assert trainer.rl_step(TrainBatch(sequences=[])) == {"skipped": 1.0, "lr": 1e-4, "step": 5.0}
    trainer.step = 1
    assert trainer.step == 1 and trainer.lr == pytest.approx(5e-4)
    # Tied embeddings counted once; the model's own parameters, padded vocabulary included.
    assert trainer.num_parameters() == sum(p.numel() for p in trainer.chunks[0].parameters())
    with pytest.raises(ValueError, match="token ids"):
        trainer.sft_step(build_sft_batch([([1], [VOCAB])]))


def test_kl_term_is_refused(single_rank):
    from megatron_rl.training.trainer import PolicyTrainer

    with pytest.raises(ValueError, match="kl_coef"):
        PolicyTrainer(_hf(), TrainerConfig(), GRPOConfig(kl_coef=0.1), BatchingConfig())


def test_decoupled_objective_through_the_trainer(single_rank):
    """``algorithm.objective: decoupled`` in the trainer: a minibatch whose proximal log-probs are
    its behaviour log-probs trains exactly as the paper's objective; one that carries none takes
    the current weights as the proximal policy, the same as carrying their log-probs (computed by
    ``compute_logprobs``), at every collation."""
    import dataclasses

    trainer = _trainer()
    seqs = _sequences(8, seed=7)
    paper = trainer.forward_backward(TrainBatch(sequences=seqs), "grpo")
    paper_grads = _grads(trainer)
    trainer.grpo.objective = "decoupled"
    trainer.grpo.behaviour_weight_cap = 0.0
    same = [dataclasses.replace(s, proximal_logprobs=s.behaviour_logprobs.clone()) for s in seqs]
    got = trainer.forward_backward(TrainBatch(sequences=same), "grpo")
    assert got["loss"] == paper["loss"] and got["behaviour_weight_mean"] == 1.0
    for name, g in _grads(trainer).items():
        assert torch.equal(g, paper_grads[name]), name

    current = trainer.compute_logprobs(TrainBatch(sequences=seqs))
    carried = [dataclasses.replace(s, proximal_logprobs=c) for s, c in zip(seqs, current)]
    implicit = trainer.forward_backward(TrainBatch(sequences=seqs), "grpo")
    implicit_grads = _grads(trainer)
    assert implicit["ratio_mean"] == 1.0 and implicit["clip_low_frac"] == implicit["clip_high_frac"] == 0.0
    assert implicit["loss"] != pytest.approx(paper["loss"])  # behaviour differs from the current weights
    for c in COLLATIONS:
        explicit = trainer.forward_backward(
            TrainBatch(sequences=carried), "grpo", batching=BatchingConfig(**c)
        )
        assert explicit["loss"] == pytest.approx(implicit["loss"], rel=1e-5), c
        assert explicit["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        for name, g in _grads(trainer).items():
            scale = implicit_grads[name].abs().max().item()
            assert (g - implicit_grads[name]).abs().max().item() <= 1e-5 * scale, (c, name)
    with pytest.raises(ValueError, match="some sequences carry them"):
        trainer.forward_backward(TrainBatch(sequences=[carried[0], seqs[1]]), "grpo")
