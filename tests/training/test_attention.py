"""Per-segment causal attention (``training/attention.py``): the same outputs and gradients as a
dense masked reference computed here, for packed rows (GQA, uneven segments, a padded tail segment)
and padded rows; a packed row builds no ``[T, T]`` tensor; the model keeps every packed sequence
to itself (RoPE restarting per sequence); a trainer step on packed rows is the step on padded rows;
malformed input is refused naming the field."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.collate import collate
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.training.attention import SegmentCausalAttention, segment_causal_attention
from megatron_rl.training.config import OptimConfig, TrainerConfig
from megatron_rl.types import TrainBatch, TrainSequence
from tests.training.conftest import tiny_llama_config

HEADS, GROUPS, HEAD_DIM = 8, 2, 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Dense attention over the whole packed row ``[t, np, hn]`` with the explicit block-diagonal
    causal mask, keys/values repeated per group, softmax in fp64."""
    t, rep = q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    allowed = torch.ones(t, t, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def _qkv(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((t, HEADS, HEAD_DIM), (t, GROUPS, HEAD_DIM), (t, GROUPS, HEAD_DIM))
    return tuple(torch.randn(*s, generator=g).requires_grad_() for s in shapes)


def _grads_of(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 1) -> list[torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad((out * weight).sum(), inputs))


@pytest.mark.parametrize(
    "cu",
    [
        [0, 5, 6, 23, 32],  # uneven segments, one of a single token
        [0, 11, 30, 37, 48],  # the last segment is a row's tail padding: a segment of its own
        [0, 19],  # one segment: plain causal attention
    ],
)
def test_packed_segments_equal_dense_masked_attention_forward_and_backward(cu):
    q, k, v = _qkv(cu[-1])
    got = segment_causal_attention(q, k, v, cu, 1.0 / math.sqrt(HEAD_DIM))
    want = _reference(q, k, v, cu)
    assert got.shape == (cu[-1], HEADS, HEAD_DIM)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads_of(got, (q, k, v)), _grads_of(want, (q, k, v))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_each_packed_sequence_sees_what_it_sees_alone():
    cu = [0, 7, 20, 26]
    q, k, v = _qkv(cu[-1], seed=3)
    packed = segment_causal_attention(q, k, v, cu, 0.25)
    for a, b in zip(cu[:-1], cu[1:]):
        alone = segment_causal_attention(q[a:b], k[a:b], v[a:b], [0, b - a], 0.25)
        torch.testing.assert_close(packed[a:b], alone, rtol=0, atol=1e-6)


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
    )
    return TransformerConfig(**{**base, **kw})


def _module(single_rank, **kw) -> SegmentCausalAttention:
    from megatron.core.transformer.enums import AttnMaskType

    return SegmentCausalAttention(_config(**kw), 1, AttnMaskType.causal, "self")


def test_module_packed_and_padded_layouts(single_rank):
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _module(single_rank)
    cu = [0, 9, 10, 31, 40]
    q, k, v = _qkv(cu[-1], seed=4)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=21, max_seqlen_kv=21
    )
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (cu[-1], HEADS * HEAD_DIM)
    torch.testing.assert_close(out, _reference(q, k, v, cu).flatten(1), rtol=1e-5, atol=1e-5)
    # Padded rows [s, b, heads, hn]: each row is plain causal attention over its own tokens.
    rows = [_qkv(12, seed=10 + r) for r in range(3)]
    qb, kb, vb = (torch.stack([r[i] for r in rows], dim=1).detach().requires_grad_() for i in range(3))
    out = attn(qb, kb, vb, None)
    assert out.shape == (12, 3, HEADS * HEAD_DIM)
    want = torch.stack([_reference(qb[:, r], kb[:, r], vb[:, r], [0, 12]) for r in range(3)], dim=1)
    torch.testing.assert_close(out, want.flatten(2), rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads_of(out, (qb, kb, vb)), _grads_of(want.flatten(2), (qb, kb, vb))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_malformed_inputs_are_refused_naming_the_field(single_rank):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    attn = _module(single_rank)
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(q[:, None], k[:, None], v[:, None], torch.zeros(1, 1, 8, 8, dtype=torch.bool))
    for cu in ([0, 5], [1, 8], [0, 6, 3, 8], []):
        with pytest.raises(ValueError, match="cu_seqlens"):
            segment_causal_attention(q, k, v, cu, 0.25)
    sbhd = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="qkv_format"):
        attn(q, k, v, None, packed_seq_params=sbhd)
    other = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
        cu_seqlens_kv=torch.tensor([0, 4, 8], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        attn(q, k, v, None, packed_seq_params=other)
    with pytest.raises(ValueError, match="attention_dropout"):
        _module(single_rank, attention_dropout=0.1)
    with pytest.raises(ValueError, match="window_size"):
        _module(single_rank, window_size=(4, 0))
    with pytest.raises(ValueError, match="attn_mask_type"):
        SegmentCausalAttention(_config(), 1, AttnMaskType.no_mask, "self")


# -- the model and the trainer ----------------------------------------------------------------------

VOCAB = 200


def _hf():
    return tiny_llama_config(VOCAB, 512)


def _sequences(lengths: list[int], seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        p = max(1, n // 3)
        c = n - p
        out.append(
            TrainSequence(
                tokens=torch.randint(0, VOCAB, (n,), generator=g),
                prompt_length=p,
                behaviour_logprobs=-math.log(VOCAB) + 0.3 * torch.randn(c, generator=g),
                versions=torch.zeros(c, dtype=torch.long),
                advantage=float(torch.randn(1, generator=g)),
                weight=1.0 / 40,
                group_id=i // 2,
            )
        )
    return out


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_packed_row_keeps_sequences_apart_without_a_dense_mask(single_rank):
    from megatron_rl.training.model import build_gpt_model
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.steps import model_inputs

    torch.manual_seed(0)
    model = build_gpt_model(_hf(), ParallelConfig())
    assert all(
        isinstance(layer.self_attention.core_attention, SegmentCausalAttention)
        for layer in model.decoder.layers
    )
    # Offsets of up to ~200 positions inside the row: RoPE must restart at every sequence.
    seqs = _sequences([61, 17, 90, 3, 40])
    mb = collate(seqs, list(range(5)), layout="packed", pad_to_multiple=16)  # 211 -> 224: a tail
    t = mb.tokens.shape[1]
    with _Shapes() as rec:
        packed = model(**model_inputs(mb))[0]  # [t, V]
    assert not [s for s in rec.shapes if sum(d == t for d in s) >= 2], "a [T, T] tensor was built"
    starts = mb.packed_cu_seqlens().tolist()
    for s, a in zip(seqs, starts):
        alone = model(
            input_ids=s.tokens[None], position_ids=torch.arange(s.length)[None], attention_mask=None
        )[0]
        torch.testing.assert_close(packed[a : a + s.length], alone, rtol=1e-5, atol=1e-5)


def _trainer(layout: str):
    from megatron_rl.training.trainer import PolicyTrainer

    torch.manual_seed(0)  # CPU initialisation draws from the default generator: the same weights
    return PolicyTrainer(
        _hf(),
        # lr = adam_eps = 1: Adam's first step moves each parameter by g / (|g| + 1), so the
        # parameters after it compare gradients at their own scale (test_trainer.py).
        TrainerConfig(optim=OptimConfig(lr=1.0, adam_eps=1.0, clip_grad=0.5)),
        GRPOConfig(),
        BatchingConfig(token_budget=128, layout=layout),
    )


def test_trainer_step_on_packed_rows_equals_the_step_on_padded_rows(single_rank):
    batch = TrainBatch(sequences=_sequences([40, 7, 25, 33, 12, 29, 18, 5], seed=2))
    runs = {}
    for layout in ("packed", "padded"):
        trainer = _trainer(layout)
        metrics = trainer.rl_step(batch)
        runs[layout] = (metrics, [p.detach().clone() for p in trainer.chunks[0].parameters()])
        trainer.close()
    (packed, packed_params), (padded, padded_params) = runs["packed"], runs["padded"]
    assert packed["padding_fraction"] == 0.0 < padded["padding_fraction"]
    assert packed["skipped"] == padded["skipped"] == 0.0
    for key in ("loss", "grad_norm", "entropy_mean", "tokens"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
    # The norm exceeds clip_grad, so the update went through the clip: same parameters after it.
    assert packed["grad_norm"] > 0.5
    for a, b in zip(packed_params, padded_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
