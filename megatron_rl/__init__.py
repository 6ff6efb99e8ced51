"""megatron-rl: reinforcement learning from verifiable rewards at cluster scale, after Magistral.

The Python API (:mod:`megatron_rl.api`): ``from megatron_rl import RunConfig, load_config, train,
score, convert_checkpoint``. Those names are imported from there on first use, so ``import megatron_rl``
(which every module of the package does) loads nothing else but the version
(:mod:`megatron_rl.version`, its one home; modules of the package read it from there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.version import __version__

__all__ = ["RunConfig", "__version__", "convert_checkpoint", "load_config", "score", "train"]

_API = ("RunConfig", "convert_checkpoint", "load_config", "score", "train")

if TYPE_CHECKING:
    from megatron_rl.api import RunConfig, convert_checkpoint, load_config, score, train


def __getattr__(name: str) -> object:
    if name in _API:
        from megatron_rl import api  # lazy: the root loads nothing else (megatron_rl/layers.py)

        return getattr(api, name)
    raise AttributeError(f"module 'megatron_rl' has no attribute {name!r}")
