"""The built-in engine's inference core: a plain-PyTorch HF-named decoder with a per-slot KV cache
(``model``) and continuous batching with per-token log-probs and weight versions (``engine``)."""

from megatron_rl.generation.engine.engine import Engine, EngineConfig, Finished, sample_token
from megatron_rl.generation.engine.model import Decoder, DecoderConfig, KVCache

__all__ = [
    "Decoder",
    "DecoderConfig",
    "Engine",
    "EngineConfig",
    "Finished",
    "KVCache",
    "sample_token",
]
