"""Fixtures for the single-process training tests: a one-rank Megatron parallel state."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import transformers


@pytest.fixture(scope="module")
def single_rank():
    """TP=PP=DP=1 in this process (a one-rank gloo group), torn down after the module."""
    from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

    owned = not dist.is_initialized()
    init_parallel(ParallelConfig(), seed=1234)
    yield
    destroy_parallel(destroy_default_group=owned)


def tiny_llama_config(vocab: int, max_positions: int, *, tied: bool = False) -> transformers.LlamaConfig:
    """The tests' tiny Llama: 2 layers of width 64, 4 heads over 2 key/value groups."""
    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
