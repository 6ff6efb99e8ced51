"""Shared fixtures: one verifier pool for the session's library-level tests, and tiny models."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rewards.pool import VerifierPool
from tests.data.tinylm import answering_model, random_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models decode faster on one intra-op thread, and two threads spin-wait for each other
    when the machine is busy (10x the CPU time measured here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def pool():
    with VerifierPool(2) as p:
        yield p


@pytest.fixture(scope="session")
def answering_folder(tmp_path_factory) -> str:
    """A bigram Llama answering \\boxed{4} (p = 0.75) or \\boxed{5}, with its tokenizer."""
    folder = tmp_path_factory.mktemp("answering")
    answering_model(folder)
    return str(folder)


@pytest.fixture(scope="session")
def random_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("random")
    random_model(folder)
    return str(folder)
