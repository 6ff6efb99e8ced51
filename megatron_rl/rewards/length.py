"""Magistral's soft length penalty (Equation 1 of the paper)."""

from __future__ import annotations

__all__ = ["length_penalty"]


def length_penalty(num_tokens: int, l_max: int, l_cache: int, penalty: float = 0.1) -> float:
    """0 up to ``l_max - l_cache`` tokens, then linear down to ``-penalty`` at ``l_max``, and
    ``-penalty`` beyond. ``l_cache = 0`` makes it a step at ``l_max``."""
    if l_cache < 0 or l_cache > l_max:
        raise ValueError(f"need 0 <= l_cache <= l_max, got l_cache={l_cache}, l_max={l_max}")
    start = l_max - l_cache
    if num_tokens <= start:
        return 0.0
    if num_tokens > l_max:
        return -penalty
    return -penalty * (num_tokens - start) / l_cache
