"""HF-named tensors <-> the parameters of one rank's Megatron model chunk.

    converter = HFConverter.for_config(hf_config)
    load_hf_into_chunk(chunk, converter, hf_state, tp_rank=r, tp_size=tp)   # HF -> this rank
    for hf_name, tensor in chunk_to_hf(chunk, converter, tp_group=tp_group): # this stage -> HF
        ...

A chunk is what :func:`megatron_rl.training.model.build_gpt_model` returns (possibly wrapped in
DDP / Float16Module): one pipeline stage, or one virtual stage under interleaving. Its layers are
numbered from 0; the global numbers come from the layers' own ``layer_number`` (so uneven
pipeline splits are right too). Each pipeline stage handles its own layers and nothing is sent
between stages; with tied embeddings the last stage's copy of the embedding is filled from the HF
embedding and skipped on the way out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.hf.layout import (
    HFConverter,
    TPSplit,
    canonical_name,
    gather_from_tp,
    shard_for_tp,
    to_global_name,
    tp_split,
)

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "chunk_global_names",
    "chunk_layer_offset",
    "chunk_to_hf",
    "iter_model_hf",
    "load_hf_into_chunk",
]


def _unwrap(chunk: MegatronModule) -> GPTModel:
    from megatron.core.utils import (
        unwrap_model,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    return unwrap_model(chunk)


def chunk_layer_offset(chunk: MegatronModule) -> int:
    """Global index of the chunk's first transformer layer (0 for a chunk without layers)."""
    layers = _unwrap(chunk).decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def chunk_global_names(chunk: MegatronModule) -> dict[str, str]:
    """Local parameter name -> canonical global name, for every parameter of ``chunk``."""
    offset = chunk_layer_offset(chunk)
    return {n: canonical_name(to_global_name(n, offset)) for n, _ in _unwrap(chunk).named_parameters()}


@torch.no_grad()
def load_hf_into_chunk(
    chunk: MegatronModule,
    converter: HFConverter,
    hf_state: Mapping[str, torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
) -> int:
    """Copy HF weights into every parameter of ``chunk`` (this rank's TP shard of each).

    ``hf_state`` maps HF names to full tensors; only the tensors this chunk needs are read, one
    parameter at a time, so a lazy mapping over safetensors files keeps one full tensor in memory
    at a time. Values are cast to each parameter's dtype and device. Returns the number of
    parameters filled; raises KeyError naming an HF tensor that is missing, or a parameter the
    converter does not know.
    """
    names = chunk_global_names(chunk)
    filled = 0
    for local, param in _unwrap(chunk).named_parameters():
        full = converter.hf_to_mcore_tensor(names[local], hf_state)
        shard = shard_for_tp(names[local], full, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"{local}: the converted shard has shape {list(shard.shape)}, the "
                f"parameter {list(param.shape)} (TP rank {tp_rank} of {tp_size})"
            )
        param.copy_(shard)
        filled += 1
    return filled


@torch.no_grad()
def chunk_to_hf(
    chunk: MegatronModule, converter: HFConverter, *, tp_group: dist.ProcessGroup | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, full tensor)`` pairs for the parameters of this chunk, in model order.

    Collective over ``tp_group`` (every TP rank of the stage must iterate to the end, in step):
    sharded parameters are all-gathered, so every TP rank gets the same full tensors. ``None``
    means TP = 1 (no communication). Tensors keep the parameters' dtypes (Megatron keeps norms in
    fp32 in a bf16 model); casting is the consumer's choice. The tied copy of the embedding on
    the last pipeline stage yields nothing.
    """
    names = chunk_global_names(chunk)
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    for local, param in _unwrap(chunk).named_parameters():
        name = names[local]
        if name == "output_layer.weight" and converter.dims.tied:
            continue  # the same decision on every TP rank, so the gathers stay in step
        full = param.detach()
        if tp > 1 and tp_split(name) is not TPSplit.REPLICATED:
            shards = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(shards, full.contiguous(), group=tp_group)
            full = gather_from_tp(name, shards)
        yield from converter.mcore_to_hf(name, full)


def _pp_info() -> tuple[int, int, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(pp rank, pp size, tp group or None, pp group) of this rank; TP=PP=1 without Megatron."""
    try:
        from megatron.core import (
            parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        if ps.model_parallel_is_initialized():
            tp = ps.get_tensor_model_parallel_group()
            return (
                ps.get_pipeline_model_parallel_rank(),
                ps.get_pipeline_model_parallel_world_size(),
                tp if dist.get_world_size(tp) > 1 else None,
                ps.get_pipeline_model_parallel_group(),
            )
    except ImportError:
        pass
    return 0, 1, None, None


def iter_model_hf(chunks: list[MegatronModule], converter: HFConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model, on global rank 0 of the first data-parallel replica,
    in model order (stage by stage). Collective over the model-parallel ranks of that replica;
    other ranks get nothing. Ranks of other data-parallel replicas must not call it."""
    pp_rank, pp_size, tp_group, pp_group = _pp_info()
    me = dist.get_rank() if dist.is_initialized() else 0
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    for stage in range(pp_size):
        src = 0 if pp_group is None else dist.get_global_rank(pp_group, stage)
        if stage == pp_rank:
            for chunk in chunks:
                for name, t in chunk_to_hf(chunk, converter, tp_group=tp_group):
                    if stage == 0:
                        if me == 0:
                            yield name, t
                    elif tp_rank == 0:
                        # stage leader -> rank 0: metadata, then the bytes
                        dist.send_object_list([name, list(t.shape), t.dtype], dst=0)
                        dist.send(t.contiguous(), dst=0)
            if stage > 0 and tp_rank == 0:
                dist.send_object_list([None, None, None], dst=0)
        elif me == 0:
            while True:
                meta = [None, None, None]
                dist.recv_object_list(meta, src=src)
                if meta[0] is None:
                    break
                t = torch.empty(meta[1], dtype=meta[2])
                dist.recv(t, src=src)
                yield meta[0], t
