"""Scoring: the rollouts' samples to the verifier pool, and every one of them scored by a deadline.

:class:`Scorer` is the rollouts' side of the verifier pool
(:class:`~megatron_rl.orchestration.rollouts.Rollouts` owns one). :meth:`Scorer.submit` hands the
samples of a group that came back whole to the pool in one call, each task within its hard limit
(the reward config goes to the workers once, not with every sample), and passes each score on as
soon as a worker has it.

**Every sample gets a score.** Each scoring task has a deadline when it is submitted (the pool's
:meth:`~megatron_rl.rewards.pool.VerifierPool.deadline`: what is queued ahead of it, each task
within its hard limit); :meth:`Scorer.expire_overdue`, which the loop's waits call through
:meth:`Rollouts.check <megatron_rl.orchestration.rollouts.Rollouts.check>`, scores a sample still
unscored past it as ``scoring_timeout`` (reward 0, counted), so a group always finishes. A task
the pool refuses or one that fails scores 0 with its reason; a pool whose workers cannot start
stops the run with its one-line reason (:class:`~megatron_rl.rewards.pool.PoolBroken`).
:meth:`Scorer.stop` cancels the scoring not yet started when the loop ends, so an evaluation never
queues behind samples nobody will train.

**Threads.** :meth:`Scorer.submit` runs on the fleet's I/O thread, the pool's answers come on its
dispatcher thread and :meth:`Scorer.expire_overdue` on the loop's. The samples being scored and
their deadlines change under the scorer's own lock, which is never held while a score or an error
is passed on (so the rollouts' lock is never taken under it). Whoever takes a sample's entry out
scores it -- the pool's answer or the deadline, never both.
"""

from __future__ import annotations

import functools
import heapq
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from megatron_rl.data.problems import reward_input
from megatron_rl.rewards.compose import RewardConfig, failed_result, hard_timeout_s, score
from megatron_rl.rewards.pool import PoolBroken, PoolTaskError
from megatron_rl.rewards.result import RewardResult

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from concurrent.futures import Future

    from megatron_rl.generation.api import GenResult
    from megatron_rl.orchestration.group_record import GroupRecord
    from megatron_rl.rewards.compose import RewardInput

__all__ = ["Scorer", "ScoringPool"]


class ScoringPool(Protocol):
    """What :class:`Scorer` needs of the verifier pool: a
    :class:`~megatron_rl.rewards.pool.VerifierPool`, or a stand-in with ``submit_many``."""

    def submit_many(
        self,
        fn: Callable[[RewardInput, RewardConfig], RewardResult],
        items: Iterable[tuple[RewardInput, RewardConfig]],
        *,
        timeout_s: Sequence[float],
    ) -> list[Future[RewardResult]]:
        """Run ``fn(inp, cfg)`` for every item in a worker, each within its own limit; a future
        fails with :class:`PoolTaskError` when its task times out, its worker dies or ``fn``
        raises."""
        ...


@dataclass(slots=True)
class _Scoring:
    """One sample with the pool: sample ``i`` of ``rec``, generated as ``result`` and decoded as
    ``text``, scored under ``reward`` by ``deadline`` (a ``time.monotonic()``)."""

    rec: GroupRecord
    i: int
    result: GenResult
    text: str
    reward: RewardConfig
    deadline: float
    future: Future[RewardResult]


class Scorer:
    """The samples being scored and their deadlines (see the module docstring)."""

    def __init__(
        self,
        pool: ScoringPool,
        *,
        on_score: Callable[[GroupRecord, int, GenResult, str, RewardResult], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """``on_score(rec, i, result, text, reward_result)``: sample ``i`` of ``rec`` has its score;
        ``on_error(e)``: the run must stop (no verifier can start)."""
        self.pool = pool
        self._on_score, self._on_error = on_score, on_error
        self._shared_reward: RewardConfig | None = None  # the config last given to pool.share
        self._lock = threading.Lock()
        # Samples being scored, by (group index, sample). Whoever pops an entry scores the
        # sample: the pool's answer or the deadline.
        self._scoring: dict[tuple[int, int], _Scoring] = {}
        # Their deadlines, soonest first: (deadline, group index, sample); entries scored since
        # are skipped when they come up (the loop's checks look at the soonest, not at them all).
        self._deadlines: list[tuple[float, int, int]] = []
        self._stopped = False  # stop(): callbacks that come later are ignored

    def submit(
        self, rec: GroupRecord, done: list[tuple[int, GenResult]], texts: list[str], reward: RewardConfig
    ) -> None:
        """Score samples ``done`` of ``rec`` (``(sample, result)``, decoded as ``texts``) under
        ``reward``: to the pool together, each with its deadline."""
        if rec.record is None:
            rec.record = rec.problem.to_json()
        inputs = [
            reward_input(
                rec.problem, text, num_tokens=r.model_tokens, group_id=rec.prompt_id, record=rec.record
            )
            for text, (_, r) in zip(texts, done)
        ]
        limits = [hard_timeout_s(inp, reward) for inp in inputs]
        if reward is not self._shared_reward:  # first, or a curriculum stage replaced it
            self._shared_reward = reward
            share = getattr(self.pool, "share", None)  # a stand-in pool may have none
            if callable(share):
                share(reward)  # sent to each worker once, not with every sample
        try:
            futs = self.pool.submit_many(score, [(inp, reward) for inp in inputs], timeout_s=limits)
        except PoolBroken as e:  # no verifier can start: the run stops, saying why
            self._on_error(e)
            return
        except BaseException as e:  # noqa: BLE001 - refused tasks: the samples score 0, say why
            for (i, result), text in zip(done, texts):
                self._on_score(rec, i, result, text, RewardResult(0.0, {}, "verifier_error", f"pool: {e}"))
            return
        deadline_fn = getattr(self.pool, "deadline", None)  # a stand-in pool may have none
        deadline = deadline_fn() if callable(deadline_fn) else time.monotonic() + max(limits) + 30.0
        with self._lock:
            if self._stopped:
                for sfut in futs:
                    sfut.cancel()
                return
            for (i, result), text, sfut in zip(done, texts, futs):
                self._scoring[(rec.index, i)] = _Scoring(rec, i, result, text, reward, deadline, sfut)
                heapq.heappush(self._deadlines, (deadline, rec.index, i))
        for (i, _), sfut in zip(done, futs):
            sfut.add_done_callback(functools.partial(self._on_scored, rec, i))

    def _on_scored(self, rec: GroupRecord, i: int, fut: Future[RewardResult]) -> None:
        """The pool's answer for sample ``i`` of ``rec`` (ignored when its deadline came first)."""
        with self._lock:
            entry = self._scoring.pop((rec.index, i), None)
        if entry is None:  # scored already (past its deadline), or the loop stopped
            return
        try:
            res: RewardResult = fut.result()
        except PoolTaskError as e:
            broken = getattr(self.pool, "broken", None)
            if broken is not None:  # the workers cannot start: stop with why, not score 0
                self._on_error(PoolBroken(broken))
                return
            res = failed_result(e.reason, e.detail, entry.reward)
        except BaseException as e:  # noqa: BLE001 - e.g. cancelled: scored 0 with the reason
            res = RewardResult(0.0, {}, "verifier_error", f"{type(e).__name__}: {e}")
        self._on_score(rec, i, entry.result, entry.text, res)

    def expire_overdue(self, now: float | None = None) -> int:
        """Score every sample whose scoring is past its deadline as ``scoring_timeout`` (its task
        cancelled if it has not started); how many."""
        now = time.monotonic() if now is None else now
        entries = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, index, i = heapq.heappop(self._deadlines)
                entry = self._scoring.get((index, i))
                if entry is not None and entry.deadline <= now:
                    entries.append(self._scoring.pop((index, i)))
            if len(self._deadlines) > 2 * len(self._scoring) + 1024:  # mostly scored: rebuild
                self._deadlines = [(v.deadline, k[0], k[1]) for k, v in self._scoring.items()]
                heapq.heapify(self._deadlines)
        for e in entries:
            e.future.cancel()
            err = PoolTaskError("scoring_timeout", "no score by its deadline; counted as failed")
            self._on_score(e.rec, e.i, e.result, e.text, failed_result(err.reason, err.detail, e.reward))
        return len(entries)

    def stop(self) -> None:
        """The loop is over: cancel the scoring that has not started and ignore what comes back."""
        with self._lock:
            self._stopped = True
            entries, self._scoring, self._deadlines = list(self._scoring.values()), {}, []
        for entry in entries:
            entry.future.cancel()
