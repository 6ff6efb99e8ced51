import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.batching.collate import collate, collation_stats, microbatch_cost, plan_microbatches
from megatron_rl.types import TrainSequence


def _seq(tokens, prompt_length, weight=0.5, advantage=1.0, group_id=0):
    c = len(tokens) - prompt_length
    return TrainSequence(
        tokens=torch.tensor(tokens),
        prompt_length=prompt_length,
        behaviour_logprobs=-torch.arange(1, c + 1, dtype=torch.float32) / 10,
        versions=torch.arange(c) + 3,
        advantage=advantage,
        weight=weight,
        group_id=group_id,
    )


def test_greedy_first_fit_decreasing_by_hand():
    lengths = [5, 4, 3, 3, 2, 1]
    # sorted: 5->A, 4->B (A full at 9), 3->A (8), 3->B (7), 2->C, 1->B (8)
    assert plan_microbatches(lengths, 8) == [[0, 2], [1, 3, 5], [4]]
    # uniform: arrival order, a new microbatch whenever the next does not fit
    assert plan_microbatches(lengths, 8, strategy="uniform") == [[0], [1, 2], [3, 4, 5]]


def test_padded_layout_cost_is_rows_times_longest():
    assert microbatch_cost([5, 3, 3], "padded") == 15
    assert microbatch_cost([5, 3, 3], "packed", pad_to_multiple=4) == 12
    # rows x longest <= 10: [5, 5] fits, then 4s pair up, the 2 joins them: 3 x 4 = 12 > 10
    assert plan_microbatches([5, 4, 5, 4, 2], 10, layout="padded") == [[0, 2], [1, 3], [4]]


def test_sequence_longer_than_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens.*token_budget"):
        plan_microbatches([3, 9], 8)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80),
    extra=st.integers(0, 600),
    layout=st.sampled_from(["packed", "padded"]),
    strategy=st.sampled_from(["greedy", "uniform"]),
    multiple=st.sampled_from([1, 8]),
)
def test_plans_cover_every_sequence_once_within_budget(lengths, extra, layout, strategy, multiple):
    budget = microbatch_cost([max(lengths)], layout, multiple) + extra
    bins = plan_microbatches(lengths, budget, layout=layout, strategy=strategy, pad_to_multiple=multiple)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(microbatch_cost([lengths[i] for i in b], layout, multiple) <= budget for b in bins)
    stats = collation_stats(lengths, bins, budget, layout, multiple)
    assert stats.microbatches >= stats.lower_bound and 0 <= stats.padding_fraction < 1


def test_packed_microbatch_alignment():
    a = _seq([10, 11, 12, 13, 14], prompt_length=2, weight=0.25, advantage=2.0)  # completion 12 13 14
    b = _seq([20, 21, 22], prompt_length=1, weight=0.5, advantage=-1.0)  # completion 21 22
    mb = collate([a, b], [4, 9], layout="packed", pad_to_multiple=4)
    assert mb.tokens.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert mb.labels.tolist() == [[11, 12, 13, 14, 0, 21, 22, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True, True, False, True, True, False]]
    assert mb.loss_weights.tolist() == [[0, 0.25, 0.25, 0.25, 0, 0.5, 0.5, 0]]
    assert mb.advantages.tolist() == [[0, 2, 2, 2, 0, -1, -1, 0]]
    assert mb.versions.tolist() == [[-1, 3, 4, 5, -1, 3, 4, -1]]
    torch.testing.assert_close(mb.behaviour_logprobs[0, 1:4], torch.tensor([-0.1, -0.2, -0.3]))
    assert mb.cu_seqlens.tolist() == [0, 5, 8] and mb.cu_seqlens.dtype == torch.int32
    assert mb.seq_index == [4, 9] and mb.num_tokens == 8
    mask = mb.attention_mask()[0, 0]
    allowed = ~mask
    assert allowed[4, :5].all() and not allowed[4, 5:].any()  # last token of a sees all of a only
    assert allowed[6, 5:7].all() and not allowed[6, :5].any() and not allowed[6, 7]
    per_seq = mb.split_per_sequence(mb.labels)
    assert [t.tolist() for t in per_seq] == [[12, 13, 14], [21, 22]]


def test_packed_tail_padding_is_its_own_segment():
    mb = collate([_seq([1, 2, 3], 1)], [0], layout="packed", pad_to_multiple=8)
    assert mb.tokens.shape == (1, 8) and mb.cu_seqlens.tolist() == [0, 3, 8]
    assert mb.loss_weights[0, 3:].eq(0).all()
    allowed = ~mb.attention_mask()[0, 0]
    assert not allowed[5, :3].any()  # padding never looks into the sequence


def test_padded_microbatch_alignment():
    a = _seq([10, 11, 12, 13, 14], prompt_length=2)
    b = _seq([20, 21, 22], prompt_length=1)
    mb = collate([a, b], [0, 1], layout="padded", pad_id=99)
    assert mb.tokens.tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 99, 99]]
    assert mb.labels.tolist() == [[11, 12, 13, 14, 0], [21, 22, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True, True, False], [True, True, False, False, False]]
    assert mb.cu_seqlens is None
    allowed = ~mb.attention_mask()
    assert allowed.shape == (2, 1, 5, 5)
    assert not allowed[1, 0, 2, 3]  # no key is padding for a real query
    assert [t.tolist() for t in mb.split_per_sequence(mb.labels)] == [[12, 13, 14], [21, 22]]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_routed_experts_sit_at_their_positions(layout):
    """Each sequence's experts (every position but its last) land where its tokens are; the last
    position and padding get the filler experts 0 .. top_k-1."""
    routed = [torch.randint(0, 8, (n - 1, 2, 3), dtype=torch.int32) for n in (5, 3)]
    seqs = [
        TrainSequence(
            tokens=torch.arange(n),
            prompt_length=2,
            behaviour_logprobs=torch.zeros(n - 2),
            versions=torch.zeros(n - 2, dtype=torch.long),
            advantage=0.0,
            weight=1.0,
            group_id=0,
            routed_experts=r,
        )
        for n, r in zip((5, 3), routed)
    ]
    mb = collate(seqs, [0, 1], layout=layout, pad_to_multiple=4)
    filler = torch.arange(3).expand(2, 3)
    got = mb.routed_experts
    if layout == "packed":
        assert got.shape == (1, 8, 2, 3)
        assert torch.equal(got[0, 0:4], routed[0].long()) and torch.equal(got[0, 5:7], routed[1].long())
        for p in (4, 7):  # each sequence's last position
            assert torch.equal(got[0, p], filler)
    else:
        assert got.shape == (2, 8, 2, 3)
        assert torch.equal(got[0, :4], routed[0].long()) and torch.equal(got[1, :2], routed[1].long())
        assert all(torch.equal(got[1, p], filler) for p in range(2, 8))
    seqs[1].routed_experts = None
    with pytest.raises(ValueError, match="routed_experts"):
        collate(seqs, [0, 1], layout=layout)
    with pytest.raises(ValueError, match="routed_experts"):  # not one per fed position
        TrainSequence(
            tokens=torch.arange(4),
            prompt_length=2,
            behaviour_logprobs=torch.zeros(2),
            versions=torch.zeros(2, dtype=torch.long),
            advantage=0.0,
            weight=1.0,
            group_id=0,
            routed_experts=torch.zeros(4, 2, 3, dtype=torch.int32),
        )
