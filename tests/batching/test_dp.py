import pytest
import torch

from megatron_rl.batching.dp import assign_data_parallel, dp_imbalance


@pytest.mark.parametrize("mode", ["permutation", "balanced"])
def test_every_sequence_once_and_counts_even(mode):
    lengths = torch.randint(10, 5000, (103,), generator=torch.Generator().manual_seed(1)).tolist()
    ranks = assign_data_parallel(lengths, 4, mode=mode, seed=3)
    assert sorted(i for r in ranks for i in r) == list(range(103))
    assert max(map(len, ranks)) - min(map(len, ranks)) <= 1


def test_permutation_is_preset_by_seed():
    lengths = list(range(1, 33))
    assert assign_data_parallel(lengths, 4, seed=7) == assign_data_parallel(lengths, 4, seed=7)
    assert assign_data_parallel(lengths, 4, seed=7) != assign_data_parallel(lengths, 4, seed=8)


def test_balanced_evens_out_long_tailed_tokens():
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(256, generator=g) * 1.2 + 7).long().clamp(1, 32768).tolist()
    perm = dp_imbalance(lengths, assign_data_parallel(lengths, 8, mode="permutation"))
    bal = dp_imbalance(lengths, assign_data_parallel(lengths, 8, mode="balanced"))
    assert bal < perm and bal < 1.05


def test_bad_arguments():
    with pytest.raises(ValueError, match="dp_size"):
        assign_data_parallel([1, 2], 0)
    with pytest.raises(ValueError, match="permutation"):
        assign_data_parallel([1, 2], 2, mode="bogus")
