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

Under expert parallelism (EP) each MoE layer's ``SequentialMLP`` holds ``L = num_experts / EP`` of
the experts: its ``local_experts.i`` is global expert ``ep_rank * L + i``, ``ep_rank`` its rank in
the module's own expert-parallel group (the same numbering as Megatron's sharded state dict). The
names here use the global numbers, so loading picks this rank's experts, and the gather brings
every expert to each rank of the expert-parallel group.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.hf.layout import HFConverter, canonical_name
from megatron_rl.hf.sharding import TPSplit, gather_from_tp, shard_for_tp, to_global_name, tp_split

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy these names are Any.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "chunk_global_names",
    "chunk_layer_offset",
    "chunk_tensors",
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


def chunk_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The chunk's weights by local name: its parameters, then the routers' ``expert_bias``
    buffers (DeepSeek-V3's score correction: part of the checkpoint, never trained here)."""
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith(".router.expert_bias")]
    return [*model.named_parameters(), *buffers]


_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class _ExpertBlock:
    """One MoE layer's local experts: how many, and the groups they are split over."""

    count: int  # local experts on this rank (num_experts / EP)
    ep_rank: int  # this rank's place in ep_group: its local expert i is global ep_rank * count + i
    ep_group: dist.ProcessGroup | None  # expert-parallel group; None = EP 1
    tp_group: dist.ProcessGroup | None  # expert tensor-parallel group; None = expert TP 1


def _group_or_none(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _expert_blocks(model: GPTModel) -> dict[str, _ExpertBlock]:
    """``"<module>.local_experts."`` -> that MoE layer's :class:`_ExpertBlock`, read from the
    modules themselves (Megatron's ``SequentialMLP`` keeps its expert groups)."""
    blocks: dict[str, _ExpertBlock] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "local_experts", None), torch.nn.ModuleList):
            ep = _group_or_none(getattr(module, "ep_group", None))
            blocks[f"{name}.local_experts."] = _ExpertBlock(
                count=module.num_local_experts,
                ep_rank=0 if ep is None else dist.get_rank(ep),
                ep_group=ep,
                tp_group=_group_or_none(getattr(module, "tp_group", None)),
            )
    return blocks


def _expert_of(local: str, blocks: Mapping[str, _ExpertBlock]) -> tuple[_ExpertBlock, int] | None:
    """(block, local expert number) of a local parameter name, or None outside the experts."""
    m = _LOCAL_EXPERT.match(local)
    if m is None or m.group(1) not in blocks:
        return None
    return blocks[m.group(1)], int(m.group(2))


def _renumber_expert(name: str, expert: int) -> str:
    """``name`` (an expert parameter's) with its expert number replaced by ``expert``."""
    m = _LOCAL_EXPERT.match(name)
    if m is None:
        raise ValueError(f"{name}: not an expert parameter (no local_experts.<n>)")
    return f"{m.group(1)}{expert}{m.group(3)}"


def chunk_global_names(chunk: MegatronModule) -> dict[str, str]:
    """Local parameter name -> canonical global name, for every weight of ``chunk`` (:func:`chunk_tensors`): global
    layer numbers and, under expert parallelism, global expert numbers."""
    model = _unwrap(chunk)
    offset = chunk_layer_offset(chunk)
    blocks = _expert_blocks(model)
    names = {}
    for n, _ in chunk_tensors(model):
        name = canonical_name(to_global_name(n, offset))
        found = _expert_of(n, blocks)
        if found is not None:
            block, i = found
            name = _renumber_expert(name, block.ep_rank * block.count + i)
        names[n] = name
    return names


@torch.no_grad()
def load_hf_into_chunk(
    chunk: MegatronModule,
    converter: HFConverter,
    hf_state: Mapping[str, torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
) -> int:
    """Copy HF weights into every parameter of ``chunk`` (this rank's TP shard of each, and
    this rank's experts under expert parallelism).

    ``hf_state`` maps HF names to full tensors; only the tensors this chunk needs are read, one
    parameter at a time, so a lazy mapping over safetensors files keeps one full tensor in memory
    at a time. Values are cast to each parameter's dtype and device. Returns the number of
    parameters filled; raises KeyError naming an HF tensor that is missing, or a parameter the
    converter does not know.
    """
    names = chunk_global_names(chunk)
    filled = 0
    for local, param in chunk_tensors(_unwrap(chunk)):
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
    means TP = 1 (no communication). Under expert parallelism it is collective over each MoE
    layer's expert-parallel group too (the group its experts record): each expert parameter is
    all-gathered there, and the tensors of all ``EP`` ranks' copies follow one another (local
    expert ``i`` of EP ranks ``0..EP-1``: global experts ``i, L + i, ...``). Tensors keep the parameters' dtypes (Megatron keeps norms in
    fp32 in a bf16 model); casting is the consumer's choice. The tied copy of the embedding on
    the last pipeline stage yields nothing.
    """
    model = _unwrap(chunk)
    names = chunk_global_names(chunk)
    blocks = _expert_blocks(model)
    for local, param in chunk_tensors(model):
        name = names[local]
        if name == "output_layer.weight" and converter.dims.tied:
            continue  # the same decision on every TP rank, so the gathers stay in step
        found = _expert_of(local, blocks)
        # Experts are TP-sharded over their own (expert tensor-parallel) group.
        group = _group_or_none(tp_group) if found is None else found[0].tp_group
        full = param.detach()
        if group is not None and tp_split(name) is not TPSplit.REPLICATED:
            shards = [torch.empty_like(full) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = gather_from_tp(name, shards)
        if found is None or found[0].ep_group is None:
            yield from converter.mcore_to_hf(name, full)
            continue
        block, i = found
        copies = [torch.empty_like(full) for _ in range(dist.get_world_size(block.ep_group))]
        dist.all_gather(copies, full.contiguous(), group=block.ep_group)
        for ep_rank, copy in enumerate(copies):
            yield from converter.mcore_to_hf(_renumber_expert(name, ep_rank * block.count + i), copy)


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits, for :func:`iter_model_hf` (all zeros / None without Megatron)."""

    pp_rank: int = 0
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None  # None when TP = 1
    pp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0  # data (x context) parallel rank: 0 = the replica whose tensors reach global rank 0
    expert_dp_rank: int = 0  # 0 on the EP ranks that together hold one copy of every expert


def _layout() -> _Layout:
    """This rank's :class:`_Layout`, from Megatron's parallel state when it is initialised."""
    try:
        from megatron.core import (
            parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        if ps.model_parallel_is_initialized():
            return _Layout(
                pp_rank=ps.get_pipeline_model_parallel_rank(),
                pp_size=ps.get_pipeline_model_parallel_world_size(),
                tp_group=_group_or_none(ps.get_tensor_model_parallel_group()),
                pp_group=ps.get_pipeline_model_parallel_group(),
                dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
                expert_dp_rank=ps.get_expert_data_parallel_rank(),
            )
    except ImportError:
        pass
    return _Layout()


def iter_model_hf(chunks: list[MegatronModule], converter: HFConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model, on global rank 0 of the first data-parallel replica,
    in model order (stage by stage). Collective over the ranks whose expert-data-parallel rank
    is 0: the model-parallel ranks of the first data-parallel replica and, under expert
    parallelism, of the next ``EP - 1`` replicas, which hold the other experts (they take part
    in the expert gathers and get nothing). Safe to call on every rank: the others return at
    once, without communicating."""
    lay = _layout()
    if lay.expert_dp_rank != 0:
        return
    me = dist.get_rank() if dist.is_initialized() else 0
    tp_rank = 0 if lay.tp_group is None else dist.get_rank(lay.tp_group)
    for stage in range(lay.pp_size):
        src = 0 if lay.pp_group is None else dist.get_global_rank(lay.pp_group, stage)
        if stage == lay.pp_rank:
            for chunk in chunks:
                for name, t in chunk_to_hf(chunk, converter, tp_group=lay.tp_group):
                    if lay.dp_rank != 0:
                        continue  # an expert-parallel peer: its part was in the gathers
                    if stage == 0:
                        if me == 0:
                            yield name, t
                    elif tp_rank == 0:
                        # stage leader -> rank 0: metadata, then the bytes
                        dist.send_object_list([name, list(t.shape), t.dtype], dst=0)
                        dist.send(t.contiguous(), dst=0)
            if stage > 0 and tp_rank == 0 and lay.dp_rank == 0:
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
