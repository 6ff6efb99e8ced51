"""One prompt's group of G samples on its way through the rollouts, as a record.

:class:`GroupRecord` holds a group from issue to scores: the prompt's tokens, each sample's
generation result and scored completion, the policy version it was issued under, and what
happened to it (samples lost with a server or timed out, kept or dropped and why). The loop reads
a kept group's staleness and trains its :meth:`GroupRecord.to_group`;
:mod:`~megatron_rl.orchestration.run_records` writes its samples and its line of the ledger.

:func:`request_seed` fixes each sample's sampling seed from the run seed, the prompt, its epoch
and the sample index, so a re-issued prompt draws the same samples under the same weights.
:meth:`GroupRecord.scored_completion` turns a sample's generation result and reward into the
record the trainer reads, its experts checked by :func:`routed_experts` under routing replay.

:class:`~megatron_rl.orchestration.rollouts.Rollouts` makes the records and fills them in under
its lock; nothing here takes a lock.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

if TYPE_CHECKING:
    import torch

    from megatron_rl.data.problems import Problem
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.api import GenResult
    from megatron_rl.rewards.result import RewardResult

__all__ = ["GroupRecord", "request_seed", "routed_experts"]


def request_seed(run_seed: int, prompt_id: str, epoch: int, sample: int) -> int:
    """A 63-bit sampling seed, the same whenever the same prompt sample is (re-)issued."""
    h = hashlib.blake2b(f"{run_seed}/{prompt_id}/{epoch}/{sample}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def routed_experts(r: GenResult, shape: tuple[int, int] | None) -> torch.Tensor | None:
    """``r``'s experts as ``[positions, layers, top_k]`` for routing replay (``shape``: ``(MoE
    layers, top_k)``), None without it (``shape`` None); ValueError saying why for a generator
    that sent none, or another shape (the rollouts check it as the results come back and stop
    the run with it)."""
    if shape is None:
        return None
    positions = len(r.prompt_ids) + len(r.token_ids) - 1
    layers, top_k = shape
    if r.routed_experts is None or r.routed_experts.numel() != positions * layers * top_k:
        got = "none" if r.routed_experts is None else f"{r.routed_experts.numel()} values"
        raise ValueError(
            f"algorithm.routing_replay: rollout needs every position's experts ({positions} x "
            f"{layers} layers x top {top_k}) from {r.server or 'the generator'}, got {got}; start "
            "SGLang with --enable-return-routed-experts (`megatron-rl sglang-args` adds it)"
        )
    return r.routed_experts.view(positions, layers, top_k)


@dataclass(kw_only=True)
class GroupRecord:
    """One prompt's G samples on their way through generation and scoring."""

    problem: Problem
    epoch: int
    index: int  # issue order over the run
    prompt_ids: list[int]
    issued_version: int
    issued_at: float
    results: list[GenResult | None]
    scored: list[ScoredCompletion | None]
    lost: int = 0  # completions re-sent after their server died
    timed_out: list[int] = field(default_factory=list)  # per sample: runs past the timeout
    kept: bool | None = None  # None until all G are scored
    drop_reason: str = ""
    done_at: float = 0.0
    remaining: int = field(default=0, repr=False)  # samples not yet scored (under Rollouts' lock)
    record: dict[str, JsonValue] | None = field(default=None, repr=False)  # problem.to_json(), once
    env_terms: dict[int, dict[str, float]] = field(
        default_factory=dict, repr=False
    )  # sample -> its environment's terms

    @property
    def key(self) -> tuple[str, int]:
        return (self.problem.id, self.epoch)

    @property
    def prompt_id(self) -> str:
        """``<problem id>@<epoch>``: the id of the prompt and of its completions."""
        return f"{self.problem.id}@{self.epoch}"

    def all_scored(self) -> list[ScoredCompletion]:
        """The G scored completions in sample order, once every one is scored (a kept or dropped
        group); raises before then."""
        done = [s for s in self.scored if s is not None]
        if len(done) != len(self.scored):
            raise RuntimeError(
                f"group {self.prompt_id}: {len(self.scored) - len(done)} of "
                f"{len(self.scored)} samples are not scored yet"
            )
        return done

    def min_version(self) -> int:
        """The policy version of the group's oldest token (the issue version before any)."""
        # -1: a trajectory's environment tokens, which no policy sampled
        sampled = [v for r in self.results if r for v in r.versions if v >= 0]
        return min(sampled, default=self.issued_version)

    def staleness(self, current: int) -> int:
        """Versions between ``current`` and the group's oldest token."""
        return current - self.min_version()

    def scored_completion(
        self, i: int, r: GenResult, text: str, res: RewardResult, *, routed_shape: tuple[int, int] | None
    ) -> ScoredCompletion:
        """Sample ``i``, generated as ``r`` and decoded as ``text``, with its score ``res``
        (``routed_shape``: see :func:`routed_experts`)."""
        return ScoredCompletion(
            completion=Completion(
                prompt_id=self.prompt_id,
                sample_index=i,
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                finish_reason=r.finish_reason,
                text=text,
                routed_experts=routed_experts(r, routed_shape),
                loss_mask=r.loss_mask,
                prompt_ids=None if r.loss_mask is None else r.prompt_ids,
            ),
            reward=float(res.reward),
            parts=dict(res.parts),
            reason=res.reason,
            correct=res.correct,
            format_ok=res.format_ok,
        )

    def to_group(self) -> Group:
        p = self.problem
        if p.task not in ("math", "code"):  # read_problems checks it; Problem.task is a plain str
            raise ValueError(f"problem {p.id}: task must be 'math' or 'code', got {p.task!r}")
        task: Literal["math", "code"] = "code" if p.task == "code" else "math"
        prompt = Prompt(
            prompt_id=self.prompt_id,
            token_ids=self.prompt_ids,
            text=p.problem,
            task=task,
            answer=p.answer,
            tests=p.tests,
            language=p.language,
        )
        return Group(prompt=prompt, completions=self.all_scored())
