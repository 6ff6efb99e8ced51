"""What every generator offers the rest of the system: requests in, finished completions out.

Two implementations share this contract:

- :class:`LocalGenerator` runs a :class:`~megatron_rl.generation.engine.Engine` in this process
  (tools and tests on a laptop, no server);
- :class:`megatron_rl.generation.client.FleetClient` sends the requests to a fleet of servers that
  speak SGLang's HTTP API (SGLang itself, or ``megatron-rl serve-engine``).

``generate(requests)`` yields a :class:`GenResult` per request *as it finishes* (not in request
order); every token carries its log-prob (``log_softmax(logits / T)`` over the full vocabulary)
and the policy version that sampled it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_rl.generation.engine import Engine, EngineConfig
from megatron_rl.types import FinishReason

if TYPE_CHECKING:
    from megatron_rl.environments.trajectory import Trajectory

__all__ = ["GenRequest", "GenResult", "Generator", "LocalGenerator"]


@dataclass(kw_only=True)
class GenRequest:
    """One prompt to complete (token ids in, token ids out)."""

    request_id: str  # unique among requests in flight
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request sampling seed (SGLang's ``sampling_seed``)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS
    return_routed_experts: bool = False  # MoE routing replay: every fed position's experts


@dataclass(kw_only=True)
class GenResult:
    """A finished request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # one per token
    versions: list[int]  # policy version that sampled each token
    finish_reason: FinishReason
    server: str = ""  # which server produced it ("local" in process)
    meta: dict = field(default_factory=dict)
    #: with ``return_routed_experts``: the experts of every position fed to the model (the
    #: prompt and the output but its last token), flat int32 ``[positions * layers * top_k]``
    #: in position, layer, rank order, as SGLang sends them; None when not asked for
    routed_experts: torch.Tensor | None = None
    #: a multi-turn trajectory put together by the rollouts: True on the tokens the model
    #: sampled, False on the environment's (``prompt_ids`` is then the trajectory's own prompt)
    loss_mask: list[bool] | None = None

    @classmethod
    def of_trajectory(cls, request_id: str, t: Trajectory) -> GenResult:
        """A whole multi-turn trajectory as one result: its own prompt, every token, the mask."""
        return cls(
            request_id=request_id,
            prompt_ids=t.prompt_ids,
            token_ids=t.token_ids,
            logprobs=t.logprobs,
            versions=t.versions,
            finish_reason="length" if t.cut else "stop",
            loss_mask=t.loss_mask,
        )

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled: all of them, but a trajectory's environment turns."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)


class Generator(Protocol):
    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """Yield one result per request, each as soon as it finishes."""


class LocalGenerator:
    """An in-process engine behind the :class:`Generator` contract.

    ``LocalGenerator.from_pretrained(folder, max_slots=16, max_len=1024)``; requests beyond the free
    slots wait in the engine's queue.
    """

    def __init__(self, engine):
        self.engine = engine

    @classmethod
    def from_pretrained(
        cls, folder, *, max_slots: int = 16, max_len: int = 1024, eos_token_ids=None
    ) -> LocalGenerator:

        return cls(
            Engine.from_pretrained(
                folder, EngineConfig(max_slots=max_slots, max_len=max_len), eos_token_ids=eos_token_ids
            )
        )

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        pending = 0
        for r in requests:
            self.engine.add_request(
                r.request_id,
                r.input_ids,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                seed=r.seed,
                stop_token_ids=r.stop_token_ids,
                return_routed_experts=r.return_routed_experts,
            )
            pending += 1
        while pending:
            for f in self.engine.step():
                pending -= 1
                yield GenResult(
                    request_id=f.request_id,
                    prompt_ids=f.prompt_ids,
                    token_ids=f.token_ids,
                    logprobs=f.logprobs,
                    versions=f.versions,
                    finish_reason=f.finish_reason,
                    server="local",
                    routed_experts=None if f.routed_experts is None else f.routed_experts.reshape(-1),
                )
