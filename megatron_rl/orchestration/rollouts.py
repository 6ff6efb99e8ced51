"""Rollouts: prompts become groups of G scored completions, generation and scoring overlapped.

:class:`Rollouts` (rank 0 of the trainer, the orchestrating process) owns the fleet client, the
verifier pool and the prompt sampler:

- :meth:`Rollouts.issue_group` renders a problem into prompt tokens and sends G requests (one
  sampling seed each, derived from the run seed, the prompt, its epoch and the sample index, so
  a re-issued prompt draws the same samples under the same weights);
- each completion goes to the verifier pool the moment it finishes (future callbacks: no thread
  waits on a batch);
- when all G completions of a group are scored the group is filtered (equal rewards dropped, with
  the reason) and either lands in :attr:`Rollouts.completed` (kept) or is recorded as dropped;
- a completion lost with its server (:class:`~megatron_rl.generation.client.ServerLost`) is
  re-sent to another live server at once; the loss is counted. A completion that comes back
  aborted (``weight_sync.pause_mode: abort``, ``/abort_request``) is re-sent too: a cut-off
  sample is never scored or trained.

Every group issued and not yet trained or dropped is *pending*; :meth:`pending_keys` is what a
checkpoint records so that a resumed run re-issues exactly those.
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.algorithms.filtering import filter_groups
from megatron_rl.data.problems import Problem, reward_input
from megatron_rl.data.sampling import decode_completion, render_prompt
from megatron_rl.generation.api import GenRequest, GenResult
from megatron_rl.generation.client import ServerLost
from megatron_rl.orchestration.sampler import PromptSampler
from megatron_rl.rewards.compose import RewardConfig, hard_timeout_s, prepare_verifiers, score
from megatron_rl.rewards.pool import PoolTaskError
from megatron_rl.rewards.result import RewardResult
from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

__all__ = ["GroupRecord", "Rollouts", "request_seed"]


def request_seed(run_seed: int, prompt_id: str, epoch: int, sample: int) -> int:
    """A 63-bit sampling seed, the same whenever the same prompt sample is (re-)issued."""
    h = hashlib.blake2b(f"{run_seed}/{prompt_id}/{epoch}/{sample}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


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
    kept: bool | None = None
    drop_reason: str = ""
    done_at: float = 0.0
    _remaining: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.problem.id, self.epoch)

    def min_version(self) -> int:
        return min((min(r.versions) for r in self.results if r and r.versions), default=self.issued_version)

    def to_group(self) -> Group:
        p = self.problem
        prompt = Prompt(
            prompt_id=f"{p.id}@{self.epoch}",
            token_ids=self.prompt_ids,
            text=p.problem,
            task=p.task,
            answer=p.answer,
            tests=p.tests,
            language=p.language,
        )
        return Group(prompt=prompt, completions=list(self.scored))


class Rollouts:
    """Generation + scoring of groups (see the module docstring)."""

    def __init__(
        self,
        *,
        fleet: Any,
        pool: Any,
        sampler: PromptSampler,
        tokenizer: Any,
        reward: RewardConfig,
        group_size: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        system_prompt: str,
        filter_tolerance: float = 0.0,
        version: Callable[[], int] = lambda: 0,
    ):
        self.fleet, self.pool, self.sampler, self.tok = fleet, pool, sampler, tokenizer
        self.reward, self.group_size = reward, group_size
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.seed, self.system_prompt = seed, system_prompt
        self.filter_tolerance = filter_tolerance
        self.version = version
        self.eos = tokenizer.eos_token_id
        self.completed: queue.Queue[GroupRecord] = queue.Queue()  # kept, scored groups
        self.dropped: list[GroupRecord] = []  # filtered out since last drain
        self.pending: dict[tuple[str, int], GroupRecord] = {}  # issued, not trained/dropped
        self.cond = threading.Condition()
        self.in_flight = 0  # sequences generating
        self._index = itertools.count()
        self.errors: list[BaseException] = []
        self.stats = Counter()  # issued/lost/generated_tokens/scored/verifier reasons
        self.lengths_ema = 0.0
        self._prompt_cache: dict[str, list[int]] = {}
        self._prepared_code = False

    # ------------------------------------------------------------------ prompts

    def render(self, problem: Problem) -> list[int]:
        ids = self._prompt_cache.get(problem.id)
        if ids is None:
            ids = render_prompt(self.tok, problem.problem, problem.task, system_prompt=self.system_prompt)
            self._prompt_cache[problem.id] = ids
        return ids

    # ------------------------------------------------------------------ issuing

    def issue_group(self, problem: Problem | None = None, epoch: int | None = None) -> GroupRecord:
        """Send the G requests of the sampler's next prompt (or of ``problem``)."""
        if problem is None:
            problem, epoch = self.sampler.next()
        ids = self.render(problem)
        rec = GroupRecord(
            problem=problem,
            epoch=int(epoch or 0),
            index=next(self._index),
            prompt_ids=ids,
            issued_version=self.version(),
            issued_at=time.monotonic(),
            results=[None] * self.group_size,
            scored=[None] * self.group_size,
            _remaining=self.group_size,
        )
        with self.cond:
            self.pending[rec.key] = rec
            self.in_flight += self.group_size
        self.stats["groups_issued"] += 1
        for i in range(self.group_size):
            self._submit(rec, i)
        return rec

    def _request(self, rec: GroupRecord, i: int) -> GenRequest:
        return GenRequest(
            request_id=f"{rec.problem.id}@{rec.epoch}#{rec.index}.{i}",
            input_ids=rec.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=request_seed(self.seed, rec.problem.id, rec.epoch, i),
            stop_token_ids=(self.eos,) if self.eos is not None else (),
        )

    def _submit(self, rec: GroupRecord, i: int, exclude: frozenset = frozenset()) -> None:
        try:
            fut = self.fleet.submit(self._request(rec, i), exclude=set(exclude))
        except ServerLost as e:  # no live server at all
            self._fail(e)
            return
        fut.add_done_callback(lambda f: self._on_generated(rec, i, f, exclude))

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            self.errors.append(e)
            self.cond.notify_all()

    def _on_generated(self, rec: GroupRecord, i: int, fut, exclude: frozenset) -> None:
        try:
            result = fut.result()
        except ServerLost as e:
            rec.lost += 1
            self.stats["requests_lost"] += 1
            self._submit(rec, i, exclude | {e.url})  # re-issue elsewhere, same seed
            return
        except BaseException as e:  # noqa: BLE001 - a refused request stops the run, with why
            self._fail(e)
            return
        if result.finish_reason == "abort":  # cut off (abort pause, /abort_request): send again
            self.stats["requests_aborted"] += 1
            self._submit(rec, i, exclude)
            return
        rec.results[i] = result
        n = len(result.token_ids)
        with self.cond:
            self.in_flight -= 1
            self.lengths_ema = n if not self.lengths_ema else 0.95 * self.lengths_ema + 0.05 * n
            self.cond.notify_all()
        self.stats["generated_tokens"] += n
        self.stats["completions"] += 1
        text = self._completion_text(result.token_ids)
        inp = reward_input(rec.problem, text, num_tokens=n, group_id=f"{rec.problem.id}@{rec.epoch}")
        if inp.task == "code" and not self._prepared_code:
            prepare_verifiers([inp], self.reward)
            self._prepared_code = True
        try:
            sfut = self.pool.submit(score, inp, self.reward, timeout_s=hard_timeout_s(inp, self.reward))
        except BaseException as e:  # noqa: BLE001 - a broken pool: the sample scores 0, says why
            self._on_scored(rec, i, text, None, e)
            return
        sfut.add_done_callback(lambda f: self._on_scored(rec, i, text, f, None))

    def _completion_text(self, token_ids: list[int]) -> str:
        return decode_completion(self.tok, token_ids)

    def _on_scored(self, rec: GroupRecord, i: int, text: str, fut, error) -> None:
        if error is None:
            try:
                res: RewardResult = fut.result()
            except PoolTaskError as e:
                res = RewardResult(0.0, {}, e.reason, e.detail)
            except BaseException as e:  # noqa: BLE001
                res = RewardResult(0.0, {}, "verifier_error", f"{type(e).__name__}: {e}")
        else:
            res = RewardResult(0.0, {}, "verifier_error", f"pool: {error}")
        r = rec.results[i]
        self.stats[f"reason/{res.reason}"] += 1
        rec.scored[i] = ScoredCompletion(
            completion=Completion(
                prompt_id=f"{rec.problem.id}@{rec.epoch}",
                sample_index=i,
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                finish_reason=r.finish_reason,
                text=text,
            ),
            reward=float(res.reward),
            parts=dict(res.parts),
            reason=res.reason,
            correct=res.correct,
            format_ok=res.format_ok,
        )
        with rec._lock:
            rec._remaining -= 1
            last = rec._remaining == 0
        if last:
            self._group_done(rec)

    def _group_done(self, rec: GroupRecord) -> None:
        rec.done_at = time.monotonic()
        rewards = torch.tensor([s.reward for s in rec.scored], dtype=torch.float64)
        flags = lambda name: torch.tensor([bool(getattr(s, name)) for s in rec.scored])
        keep, report = filter_groups(
            rewards,
            torch.zeros(len(rewards), dtype=torch.long),
            tolerance=self.filter_tolerance,
            correct=flags("correct"),
            format_ok=flags("format_ok"),
        )
        rec.kept = bool(keep.all())
        if all(s.correct for s in rec.scored):
            self.sampler.solved.add(rec.problem.id)
        with self.cond:
            if rec.kept:
                self.completed.put(rec)
            else:
                rec.drop_reason = next(r for r, n in report.dropped.items() if n)
                self.dropped.append(rec)
                self.pending.pop(rec.key, None)
            self.cond.notify_all()

    # ------------------------------------------------------------------ accounting

    def retire(self, rec: GroupRecord) -> None:
        """The group was trained (or dropped by the trainer side): no longer pending."""
        with self.cond:
            self.pending.pop(rec.key, None)

    def pending_keys(self) -> list[tuple[str, int]]:
        """Prompts issued and neither trained nor dropped, in issue order."""
        with self.cond:
            return [r.key for r in sorted(self.pending.values(), key=lambda r: r.index)]

    def drain_dropped(self) -> list[GroupRecord]:
        with self.cond:
            out, self.dropped = self.dropped, []
        return out

    def check(self) -> None:
        """Raise the first error a callback met (a refused request, no live server)."""
        if self.errors:
            raise RuntimeError(f"rollouts failed: {self.errors[0]}") from self.errors[0]
