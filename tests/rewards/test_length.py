import pytest

from megatron_rl.rewards.length import length_penalty


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, 0.0),
        (12000, 0.0),
        (12288, 0.0),  # up to l_max - l_cache: nothing
        (13312, -0.025),
        (14336, -0.05),
        (16384, -0.1),  # linear ramp
        (16385, -0.1),
        (100000, -0.1),  # beyond l_max
    ],
)
def test_soft_length_penalty(n, expected):
    assert length_penalty(n, l_max=16384, l_cache=4096) == pytest.approx(expected)


def test_step_and_errors():
    assert length_penalty(10, l_max=10, l_cache=0) == 0.0
    assert length_penalty(11, l_max=10, l_cache=0) == -0.1
    with pytest.raises(ValueError, match="l_cache"):
        length_penalty(1, l_max=10, l_cache=11)
