"""Curriculum stages (``curriculum:`` in the recipe): the loop, reward and sampler settings a run
changes as it goes, each stage entered at a step or when a metric's recent mean crosses a
threshold (:class:`~megatron_rl.orchestration.config.StageConfig`).

:class:`Curriculum` keeps the index of the stages applied so far (saved with each checkpoint,
so a resumed run re-applies them); rank 0 decides when the next stage is due and every rank
applies it, to the recipe object the trainer shares and to the orchestrator, the rollouts and
the prompt sampler where this rank holds them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.orchestration.loop import Orchestrator
    from megatron_rl.orchestration.recipe import RunConfig
    from megatron_rl.orchestration.sampler import PromptSampler

__all__ = ["Curriculum"]


class Curriculum:
    """Applies the recipe's :class:`~megatron_rl.orchestration.config.StageConfig` stages in order
    (rank 0 decides, all ranks apply)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.stages = cfg.curriculum
        self.index = 0  # stages applied so far

    def due(self, step: int, history: list[dict[str, float]]) -> bool:
        if self.index >= len(self.stages):
            return False
        st = self.stages[self.index]
        if st.at_step is not None:
            return step >= st.at_step
        metric, threshold = st.metric, st.threshold
        if metric is None or threshold is None:  # StageConfig requires at_step or metric + threshold
            raise ValueError(f"curriculum.{self.index}: neither at_step nor metric + threshold is set")
        vals = [h[metric] for h in history[-st.window :] if metric in h]
        if len(vals) < st.window:
            return False
        mean = sum(vals) / len(vals)
        return mean >= threshold if st.above else mean <= threshold

    def apply(self, upto: int, orch: Orchestrator | None, sampler: PromptSampler | None) -> list[str]:
        """Apply stages until ``upto`` are applied; return their names."""
        names = []
        while self.index < upto:
            st = self.stages[self.index]
            loop = {
                k: getattr(st, k) for k in ("n_batch", "n_minibatch", "n_async") if getattr(st, k) is not None
            }
            if loop:
                self.cfg.loop = dataclasses.replace(self.cfg.loop, **loop)
                if orch is not None:
                    orch.loop = self.cfg.loop
                    orch.queue.maxsize = self.cfg.loop.queue_capacity()
            rew = {k: getattr(st, k) for k in ("l_max", "l_cache") if getattr(st, k) is not None}
            if rew:
                self.cfg.reward = dataclasses.replace(self.cfg.reward, **rew)
                if orch is not None and orch.rollouts is not None:
                    orch.rollouts.reward = self.cfg.reward
                    orch.rollouts.max_new_tokens = self.cfg.reward.l_max
            if st.eps_high is not None:
                self.cfg.algorithm.eps_high = st.eps_high  # the trainer holds the same object
            if sampler is not None:
                for k in ("min_difficulty", "max_difficulty", "drop_solved"):
                    if getattr(st, k) is not None:
                        setattr(sampler, k, getattr(st, k))
            names.append(st.name or f"stage{self.index + 1}")
            self.index += 1
        return names
