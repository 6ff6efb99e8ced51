"""Checkpoint conversion between Hugging Face safetensors and Megatron-Core dist checkpoints
(``megatron-rl convert``); the name map itself lives in :mod:`megatron_rl.hf.layout`.

The names below are imported on first use, so that building the ``megatron-rl`` parser (which
imports :mod:`megatron_rl.convert.cli`) does not import torch."""

__all__ = ["McoreCheckpoint", "hf_to_mcore", "mcore_to_hf"]


def __getattr__(name: str):
    if name in __all__:
        from megatron_rl.convert import checkpoint  # lazy: building the CLI parser must not import torch

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'megatron_rl.convert' has no attribute {name!r}")
