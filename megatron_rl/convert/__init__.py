"""Checkpoint conversion between Hugging Face safetensors and Megatron-Core dist checkpoints
(``megatron-rl convert``); the name map itself lives in :mod:`megatron_rl.hf.layout`.

The names below are imported on first use, so that building the ``megatron-rl`` parser (which
imports :mod:`megatron_rl.convert.cli`) does not import torch."""

__all__ = ["McoreCheckpoint", "hf_to_mcore", "mcore_to_hf"]


def __getattr__(name: str):
    if name == "McoreCheckpoint":
        from megatron_rl.convert import checkpoint  # lazy: building the CLI parser must not import torch

        return checkpoint.McoreCheckpoint
    if name == "hf_to_mcore":
        from megatron_rl.convert import from_hf  # lazy: building the CLI parser must not import torch

        return from_hf.hf_to_mcore
    if name == "mcore_to_hf":
        from megatron_rl.convert import to_hf  # lazy: building the CLI parser must not import torch

        return to_hf.mcore_to_hf
    raise AttributeError(f"module 'megatron_rl.convert' has no attribute {name!r}")
