"""Records that cross stage boundaries; nothing else does.

prompts (``Prompt``) -> generation (``Completion``: tokens, behaviour log-probs, policy version per
token) -> verifiers (``ScoredCompletion``: reward and its parts) -> ``Group`` (one prompt, G scored
completions) -> batch builder (``TrainBatch`` of ``TrainSequence``) -> trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "DROP_REASONS",
    "Completion",
    "FilterReport",
    "Group",
    "Prompt",
    "ScoredCompletion",
    "TrainBatch",
    "TrainSequence",
]

FinishReason = Literal["stop", "length", "abort"]


#: Why a group was dropped, in the order they are tested.
DROP_REASONS = ("all_format_failed", "all_correct", "all_wrong", "equal_reward")


@dataclass
class FilterReport:
    """How many groups the filter kept and dropped, with the reason for each drop."""

    groups_total: int = 0
    groups_kept: int = 0
    completions_kept: int = 0
    completions_dropped: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})

    @property
    def groups_dropped(self) -> int:
        return sum(self.dropped.values())

    def merge(self, other: FilterReport) -> FilterReport:
        """Sum of two reports (for accumulating over a step)."""
        return FilterReport(
            groups_total=self.groups_total + other.groups_total,
            groups_kept=self.groups_kept + other.groups_kept,
            completions_kept=self.completions_kept + other.completions_kept,
            completions_dropped=self.completions_dropped + other.completions_dropped,
            dropped={r: self.dropped[r] + other.dropped[r] for r in DROP_REASONS},
        )

    def as_metrics(self, prefix: str = "filter/") -> dict[str, float]:
        out: dict[str, float] = {
            f"{prefix}groups_total": self.groups_total,
            f"{prefix}groups_kept": self.groups_kept,
            f"{prefix}groups_dropped": self.groups_dropped,
        }
        out.update({f"{prefix}dropped_{r}": n for r, n in self.dropped.items()})
        return out


@dataclass(kw_only=True)
class Prompt:
    """A problem as the generator sees it."""

    prompt_id: str
    token_ids: list[int]  # chat-templated prompt, system prompt included
    text: str = ""  # the problem statement (the language check reads it)
    task: Literal["math", "code"] = "math"
    answer: str | None = None  # math reference answer
    tests: list[dict[str, Any]] | None = None  # code tests, as JSON (Any: their fields vary by source)
    language: str | None = None  # expected language, when known
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Completion:
    """One sampled answer; every token carries the log-prob and policy version that produced it."""

    prompt_id: str
    sample_index: int  # index within the group, 0..G-1
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token, recorded at generation
    versions: list[int]  # policy version that generated each token
    finish_reason: FinishReason = "stop"
    text: str = ""
    # MoE routing replay: the experts of every position fed to the generator (prompt and
    # completion tokens but the last), [P + C - 1, layers, top_k] int32; None when not recorded
    routed_experts: torch.Tensor | None = None
    # A multi-turn trajectory: True where the model sampled the token, False on the environment's
    # rendered turns (context: no loss, log-prob 0.0, version -1); None = every token sampled
    loss_mask: list[bool] | None = None
    # A multi-turn trajectory's own prompt (its environment's reset, rendered); None = the group's
    prompt_ids: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"Completion {self.prompt_id}/{self.sample_index}: token_ids ({n}), logprobs "
                f"({len(self.logprobs)}) and versions ({len(self.versions)}) must have equal length"
            )
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(
                f"Completion {self.prompt_id}/{self.sample_index}: loss_mask has {len(self.loss_mask)} "
                f"entries for {n} tokens"
            )

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled (all of them, but for a multi-turn trajectory's environment turns)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)


@dataclass(kw_only=True)
class ScoredCompletion:
    """A completion with its reward, the reward's parts and the reason (``ok``, ``format_error``, ...)."""

    completion: Completion
    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    reason: str = "ok"
    correct: bool | None = None  # the answer check passed (None: not evaluated)
    format_ok: bool | None = None  # the format check passed


@dataclass(kw_only=True)
class Group:
    """All completions sampled for one prompt."""

    prompt: Prompt
    completions: list[ScoredCompletion]


@dataclass(kw_only=True)
class TrainSequence:
    """One prompt + completion ready for the trainer.

    ``tokens`` is ``[P + C]`` (prompt then completion); the per-token fields ``[C]`` belong to the
    completion tokens. ``weight`` is the loss weight of each of its completion tokens (the whole
    normalisation, see ``batching/weights.py``); ``advantage`` is shared by all its tokens.
    """

    tokens: torch.Tensor  # [P + C] int64
    prompt_length: int
    behaviour_logprobs: torch.Tensor  # [C] float32
    versions: torch.Tensor  # [C] int64
    advantage: float
    weight: float
    group_id: int
    reward: float = 0.0
    routed_experts: torch.Tensor | None = None  # [P + C - 1, layers, top_k] int32 (routing replay)
    # [C] float32: log-probs under the weights at the start of the step (decoupled objective);
    # None = the weights being trained are still those (the step's first minibatch)
    proximal_logprobs: torch.Tensor | None = None
    # [C] bool: the completion tokens that carry loss (a multi-turn trajectory's model tokens);
    # None = all of them. ``weight`` is normalised by the True ones only.
    loss_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        c = self.completion_length
        if self.prompt_length < 1 or c < 1:
            raise ValueError(
                f"a sequence needs >= 1 prompt and >= 1 completion token, got "
                f"prompt {self.prompt_length}, completion {c}"
            )
        if self.behaviour_logprobs.shape != (c,) or self.versions.shape != (c,):
            raise ValueError(
                f"per-token fields must be [{c}], got behaviour_logprobs "
                f"{tuple(self.behaviour_logprobs.shape)}, versions {tuple(self.versions.shape)}"
            )
        if self.proximal_logprobs is not None and self.proximal_logprobs.shape != (c,):
            raise ValueError(
                f"proximal_logprobs must be [{c}] like behaviour_logprobs, got {tuple(self.proximal_logprobs.shape)}"
            )
        if self.loss_mask is not None and (
            self.loss_mask.shape != (c,) or self.loss_mask.dtype != torch.bool
        ):
            raise ValueError(
                f"loss_mask must be [{c}] bool, got {tuple(self.loss_mask.shape)} {self.loss_mask.dtype}"
            )
        routed = self.routed_experts
        if routed is not None and (routed.dim() != 3 or routed.shape[0] != self.length - 1):
            raise ValueError(
                f"routed_experts must be [{self.length - 1}, layers, top_k] (every position but the "
                f"last), got {tuple(routed.shape)}"
            )

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def completion_length(self) -> int:
        return self.length - self.prompt_length


@dataclass(kw_only=True)
class TrainBatch:
    """A minibatch: sequences of the kept groups, with the filter's report."""

    sequences: list[TrainSequence]
    filter_report: FilterReport = field(default_factory=FilterReport)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.sequences]

    def subset(self, indices: list[int]) -> TrainBatch:
        """The sequences at ``indices`` (for a data-parallel rank); weights are kept as they are."""
        return TrainBatch(sequences=[self.sequences[i] for i in indices], filter_report=self.filter_report)
