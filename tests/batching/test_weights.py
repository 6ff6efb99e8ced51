import pytest
import torch

from megatron_rl.batching.weights import loss_token_weights


def test_group_mode_by_hand():
    # group 0: lengths 2 and 6 (8 tokens); group 1: lengths 4 and 4 (8 tokens); 2 groups.
    w = loss_token_weights(torch.tensor([2, 6, 4, 4]), torch.tensor([0, 0, 5, 5]), "group")
    torch.testing.assert_close(w, torch.tensor([1 / 16] * 4, dtype=torch.float64))
    w = loss_token_weights(torch.tensor([2, 6, 1]), torch.tensor([0, 0, 1]), "group")
    torch.testing.assert_close(w, torch.tensor([1 / 16, 1 / 16, 1 / 2], dtype=torch.float64))


def test_token_and_sequence_modes_by_hand():
    lengths, groups = torch.tensor([2, 6, 2]), torch.tensor([0, 0, 1])
    torch.testing.assert_close(
        loss_token_weights(lengths, groups, "token"), torch.full((3,), 0.1, dtype=torch.float64)
    )
    torch.testing.assert_close(
        loss_token_weights(lengths, groups, "sequence"),
        torch.tensor([1 / 6, 1 / 18, 1 / 6], dtype=torch.float64),
    )


@pytest.mark.parametrize("mode", ["group", "token", "sequence"])
def test_token_weights_sum_to_one(mode):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 500, (64,), generator=g)
    groups = torch.randint(0, 9, (64,), generator=g)
    w = loss_token_weights(lengths, groups, mode)
    assert float((w * lengths).sum()) == pytest.approx(1.0)


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        loss_token_weights(torch.tensor([0, 3]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="'group'"):
        loss_token_weights(torch.tensor([1]), torch.tensor([0]), "bogus")
