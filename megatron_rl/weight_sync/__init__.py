"""Weights from the trainer to the generators: the HF-name map per architecture (shared with the
checkpoint converter), HF tensors <-> one rank's TP/PP shards, and (later) the bucketed
broadcast."""

from megatron_rl.weight_sync.chunks import (chunk_global_names, chunk_layer_offset, chunk_to_hf,
                                            load_hf_into_chunk)
from megatron_rl.weight_sync.hf_map import (CONVERTERS, HFConverter, ModelDims, TPSplit,
                                            WeightsMismatchError, canonical_name, gather_from_tp,
                                            layer_offset, local_spec_name, shard_for_tp,
                                            to_global_name, to_local_name, tp_split)

__all__ = ["CONVERTERS", "HFConverter", "ModelDims", "TPSplit", "WeightsMismatchError",
           "canonical_name", "chunk_global_names", "chunk_layer_offset", "chunk_to_hf",
           "gather_from_tp", "layer_offset", "load_hf_into_chunk", "local_spec_name",
           "shard_for_tp", "to_global_name", "to_local_name", "tp_split"]
