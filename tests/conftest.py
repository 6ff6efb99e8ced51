"""Test set-up: ``gpu`` and ``sglang`` tests skip cleanly, with the reason, where they cannot run."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _sglang_reason() -> str | None:
    if not torch.cuda.is_available():
        return "sglang: needs a CUDA GPU for a real SGLang server"
    if importlib.util.find_spec("sglang") is None:
        return "sglang: the sglang package is not installed (pip install -e '.[gpu]')"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_reason = None if torch.cuda.is_available() else "gpu: no CUDA device on this machine"
    sglang_reason = _sglang_reason()
    for item in items:
        if gpu_reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
        if sglang_reason and "sglang" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=sglang_reason))


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores here: keep intra-op threads from oversubscribing when tests spawn ranks.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
