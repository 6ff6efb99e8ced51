"""MoE routing replay (R3): the trainer's routers take the experts the generators routed each token
to, so the experts that produced a token are the ones its gradient trains.

With ``algorithm.routing_replay: rollout`` the model is built with Megatron-Core's
``moe_enable_routing_replay`` (a ``RouterReplay`` per MoE layer's ``TopKRouter``), and before each
microbatch's forward :func:`set_routing` hands every router of the chunk its layer's experts from
the microbatch (``Microbatch.routed_experts [R, S, layers, top_k]``, from the rollout; every
layer, as SGLang reports them: DeepSeek-V3's leading dense layers hold zeros, read by no router). The router
then takes those experts instead of its own top-k and weighs them by its own scores gathered at
them -- softmax over the replayed experts' logits when the top-k is renormalised (Qwen3-MoE with
``norm_topk_prob``, Mixtral), the full softmax's probabilities otherwise -- so the gradient still
reaches the router through the weights. A token whose experts straddled a weight update on the
generator keeps the experts actually used (the engine records them as it routes).

Token order: a router sees its layer's hidden states ``[S, R, h]`` flattened row-major, so the
targets are the microbatch's ``[R, S]`` experts transposed to ``[S, R]``; under sequence
parallelism (Transformer Engine, TP > 1) each TP rank holds ``S / TP`` consecutive positions and
takes its slice. Backward does not run the routers again unless activations are recomputed, which
the trainer refuses together with replay (``trainer.recompute``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = ["replay_routers", "set_routing"]

# model chunk -> [(global layer index, its RouterReplay)], found once per chunk
_ROUTERS: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[int, object]]] = weakref.WeakKeyDictionary()


def replay_routers(model: MegatronModule) -> list[tuple[int, object]]:
    """``(global layer index, RouterReplay)`` of every MoE layer of the chunk ``model`` (wrapped or
    not) built with routing replay; empty when there is none."""
    if model not in _ROUTERS:
        from megatron.core.transformer.moe.router import (
            TopKRouter,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        found = [
            (int(m.layer_number) - 1, m.router_replay)
            for m in model.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None
        ]
        _ROUTERS[model] = sorted(found, key=lambda pair: pair[0])
    return _ROUTERS[model]


def set_routing(model: MegatronModule, routed: torch.Tensor | None) -> None:
    """Make every replaying router of the chunk ``model`` take its layer's experts of ``routed``
    (``[R, S, layers, top_k]``) in the next forward; ``None``: route by the router's own top-k
    (a microbatch without recorded experts, e.g. SFT or padding). A no-op for a model built
    without replay."""
    routers = replay_routers(model)
    if not routers:
        return
    from megatron.core import (
        parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
    )
    from megatron.core.transformer.moe.router_replay import (
        RouterReplayAction,  # lazy: megatron-core takes seconds to import; only this path needs it
    )

    config = getattr(model, "config", None)
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    for layer, replay in routers:  # the rollout's experts: every layer (dense ones hold zeros)
        replay.clear_indices()  # type: ignore[attr-defined]
        if routed is None:
            replay.clear_router_replay_action()  # type: ignore[attr-defined]
            continue
        if layer >= routed.shape[2]:
            raise ValueError(
                f"routed_experts: the model has MoE layer {layer}, the rollout's experts cover "
                f"{routed.shape[2]} layers"
            )
        targets = routed[:, :, layer, :].transpose(0, 1)  # [S, R, top_k]: the router's token order
        if sequence_parallel:
            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            targets = targets.chunk(tp, dim=0)[rank]
        replay.set_target_indices(targets.reshape(-1, targets.shape[-1]).long())  # type: ignore[attr-defined]
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)  # type: ignore[attr-defined]
