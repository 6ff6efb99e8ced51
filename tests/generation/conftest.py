"""Fixtures for the fleet tests: a tiny HF model folder and the one-rank trainer state."""

from __future__ import annotations

import socket

import pytest
import torch
import transformers

from tests.training.conftest import single_rank  # noqa: F401

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random fp32 Llama saved with ``save_pretrained`` (no EOS: generations run to length)."""
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.float().save_pretrained(folder)
    return str(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
