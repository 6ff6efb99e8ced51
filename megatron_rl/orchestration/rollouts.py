"""Rollouts: prompts become groups of G scored completions, generation and scoring overlapped.

:class:`Rollouts` (rank 0 of the trainer, the orchestrating process) owns the fleet client, the
verifier pool and the prompt sampler:

- :meth:`Rollouts.issue_group` renders a problem into prompt tokens and sends its G samples to
  one server in one request (:meth:`~megatron_rl.generation.client.FleetClient.submit_batch`;
  one sampling seed each, derived from the run seed, the prompt, its epoch and the sample index,
  so a re-issued prompt draws the same samples under the same weights: a
  :class:`~megatron_rl.orchestration.group_record.GroupRecord` follows the group from here). The control plane's work
  is per group, not per sample: one HTTP request, one reply, one callback, one lock section and
  one hand-over to the verifier pool for G samples, and the server prefills the prompt once;
- the group's completions go to the verifier pool together the moment they are back (future
  callbacks: no thread waits on a batch), each scored as soon as a worker has it
  (:class:`~megatron_rl.orchestration.scoring.Scorer`);
- when all G completions of a group are scored the group is filtered (equal rewards dropped, with
  the reason) and either waits in the completed queue (kept: :meth:`Rollouts.take_completed`) or
  is recorded as dropped (:meth:`Rollouts.drain_dropped`);
- completions lost with their server (:class:`~megatron_rl.generation.client.ServerLost`) are
  re-sent to another live server at once; the losses are counted. A completion that comes back
  aborted (``weight_sync.pause_mode: abort``, ``/abort_request``) is re-sent too: a cut-off
  sample is never scored or trained. A request that ran past the fleet's ``request_timeout_s``
  (aborted by the client on its server) is re-sent once, to another server where there is one;
  if it times out again it is scored as it stands (no tokens: no reward), so a request that can
  never finish costs its group, not the run.
- **Every sample gets a score**, by a deadline set when it goes to the pool
  (:mod:`~megatron_rl.orchestration.scoring`): :meth:`Rollouts.check`, which the loop's waits
  call, scores a sample still unscored past it as ``scoring_timeout`` (reward 0, counted), so a
  group always finishes. A pool whose workers cannot start stops the run with its one-line reason
  (:class:`~megatron_rl.rewards.pool.PoolBroken`). :meth:`Rollouts.stop` cancels the scoring not
  yet started when the loop ends, so an evaluation never queues behind samples nobody will train.
- **No progress.** If ``stall_groups`` groups in a row are all dropped (every group's rewards
  equal: problems that cannot be solved or cannot fail, a broken reward, answers missing), no
  batch can ever fill: :meth:`Rollouts.check` raises :class:`NoProgressError` with the drop
  reasons and the verifiers' reasons of those groups, instead of the loop waiting forever.

Every group issued and not yet trained or dropped is *pending*: a kept group stays pending until
its consumer calls :meth:`Rollouts.retire` (trained) or :meth:`Rollouts.reissue` (sent back to
the sampler, to be issued again first). :meth:`Rollouts.state_dict` is what a checkpoint records
(the sampler's cursor with the pending prompts ahead of its re-issue queue, and the counters), so
a resumed run re-issues exactly those.

**Threads.** Groups are issued from the loop's threads; completions come back on the fleet's
I/O thread (decoded and handed to the pool there: nothing on that path blocks) and their scores
on the pool's dispatcher thread. Every piece of shared state (the pending groups, the sequences
in flight, the counters, the error list, each record's results) changes under one lock,
``Rollouts._lock``, which a condition variable shares: :meth:`Rollouts.wait_until` waits on it
for a predicate, and the changes it may be waiting for wake it. The lock is re-entrant so that a
predicate may read the public properties. Drawing a prompt from the sampler and recording it as
pending happen under it together, and so do the reads of a checkpoint, so a checkpoint never
misses a prompt that was drawn but not yet recorded. The sampler has a lock of its own, always
taken after this one; the scorer's (the samples with the verifier pool) is never held while it
calls back into the rollouts.
"""

from __future__ import annotations

import array
import functools
import itertools
import queue
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Protocol

from megatron_rl.algorithms.filtering import group_drop_reason
from megatron_rl.data.problems import Problem, reward_input
from megatron_rl.data.sampling import completion_decoder, render_prompt
from megatron_rl.errors import UsageError, UserError
from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import ClientClosed, ServerLost
from megatron_rl.hf.arch import routed_shape
from megatron_rl.orchestration.group_record import GroupRecord, request_seed, routed_experts
from megatron_rl.orchestration.scoring import Scorer
from megatron_rl.orchestration.trajectories import Trajectories
from megatron_rl.rewards.compose import (
    RewardConfig,
    prepare_verifiers,
)
from megatron_rl.rewards.result import RewardResult

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from concurrent.futures import Future

    from transformers import PreTrainedTokenizerBase

    from megatron_rl.environments.config import EnvConfig
    from megatron_rl.generation.api import GenResult
    from megatron_rl.orchestration.recipe import RunConfig
    from megatron_rl.orchestration.sampler import PromptSampler
    from megatron_rl.orchestration.scoring import ScoringPool

__all__ = [
    "Fleet",
    "NoProgressError",
    "Rollouts",
]


class Fleet(Protocol):
    """What :class:`Rollouts` needs of the fleet: a
    :class:`~megatron_rl.generation.client.FleetClient`, or a stand-in with these methods."""

    def submit_batch(
        self,
        reqs: Sequence[GenRequest],
        *,
        exclude: set[str],
        on_results: Callable[[list[GenResult]], None],
    ) -> Future[list[GenResult]]:
        """Send requests (one group's samples) together to a live server not in ``exclude``;
        hand each result to ``on_results`` once, as it finishes or with the others, in calls
        that never overlap and all come before the future settles (on the fleet's I/O thread:
        :meth:`_on_results` never blocks); the future fails with
        :class:`~megatron_rl.generation.client.ServerLost` if that server dies (the requests
        not handed over are lost)."""
        ...

    def capacity_tokens(self) -> int:
        """The live servers' KV capacity in tokens (0 when unknown)."""
        ...

    def streams_batches(self) -> bool:
        """Whether every live server hands a group's samples back one by one as they finish."""
        ...


class NoProgressError(RuntimeError):
    """Every group for a long stretch was dropped: no batch can fill (see the module docstring)."""


class Rollouts:
    """Generation + scoring of groups, and their accounting (see the module docstring).

    Build it with :meth:`from_config`. The public surface is what a loop needs: issue groups,
    wait for a condition on the counts, take kept groups, retire or re-issue them, read
    counters and save the state; nothing else is meant to be read or changed from outside.
    ``reward`` and ``max_new_tokens`` are plain attributes a curriculum stage may set between
    steps (read as each request is sent and each completion scored).
    """

    def __init__(
        self,
        *,
        fleet: Fleet,
        pool: ScoringPool,
        sampler: PromptSampler,
        tokenizer: PreTrainedTokenizerBase,
        reward: RewardConfig,
        group_size: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        system_prompt: str,
        filter_tolerance: float = 0.0,
        stall_groups: int = 0,
        version: Callable[[], int] = lambda: 0,
        group_requests: bool | str = "auto",
        routed_shape: tuple[int, int] | None = None,
        env: EnvConfig | None = None,
    ):
        """``stall_groups``: this many groups dropped in a row stop the run (0: never);
        ``group_requests``: a group's samples go to one server in one request (else one each);
        ``"auto"``: where the fleet streams them back one by one (:meth:`Fleet.streams_batches`);
        ``routed_shape``: ``(MoE layers, top_k)`` to ask the generators for every position's
        experts and keep them with each completion (routing replay), None not to; ``env``: a
        multi-turn environment (``env.custom`` set): every sample is a trajectory
        (:mod:`~megatron_rl.orchestration.trajectories`), one request per model turn."""
        if group_requests not in ("auto", True, False):
            raise ValueError(f"group_requests: must be true, false or 'auto', got {group_requests!r}")
        self.group_requests = fleet.streams_batches() if group_requests == "auto" else bool(group_requests)
        self.fleet, self.sampler, self.tok = fleet, sampler, tokenizer
        self.scorer = Scorer(pool, on_score=self._score, on_error=self.fail)
        self.reward, self.group_size = reward, group_size
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.seed, self.system_prompt = seed, system_prompt
        self.filter_tolerance = filter_tolerance
        self.stall_groups = stall_groups
        self.routed_shape = routed_shape
        self._dropped_in_a_row: list[GroupRecord] = []  # since the last kept group
        self.version = version
        self.eos = tokenizer.eos_token_id
        self._decode = completion_decoder(tokenizer)
        self._lock = threading.RLock()  # re-entrant: wait_until's predicates read the properties
        self._cond = threading.Condition(self._lock)
        self._completed: queue.Queue[GroupRecord] = queue.Queue()  # kept, scored groups
        self._dropped: list[GroupRecord] = []  # filtered out since the last drain
        self._pending: dict[tuple[str, int], GroupRecord] = {}  # issued, not trained/dropped
        self._in_flight = 0  # sequences generating
        self._unscored = 0  # sequences issued whose score is not in yet (generating or scoring)
        self._busy_s = 0.0  # time with a sequence in flight, up to _busy_since
        self._busy_since: float | None = None  # when the current busy stretch began
        self._index = itertools.count()
        self._errors: list[BaseException] = []
        # Samples that found no live server, (record, samples, servers to avoid): sent again by
        # check() once one is back (orchestration/fleet_health.py restarts or waits for them).
        self._parked: list[tuple[GroupRecord, list[int], frozenset[str]]] = []
        self._stats: Counter[str] = Counter()  # issued/lost/generated_tokens/scored/verifier reasons
        self._length_ema = 0.0
        # Rendered prompts, packed (4 bytes a token, not a pointer and an int object: ~40 at a
        # real vocabulary's ids; 100k problems x 300 tokens is 120 MB, not 1.2 GB).
        self._prompt_cache: dict[str, array.array[int]] = {}
        self._max_prompt = 0  # the longest prompt in the cache (read by every room check)
        self._room_at = -1  # a score wakes the waiters when _unscored is down to this (wait_until)
        self._plain_waiters = 0  # wait_until calls without outstanding_at_most (any count may matter)
        self._prepared: set[str | None] | None = None  # code languages set up (None: none looked at)
        self.env: Trajectories | None = None
        if env is not None and env.enabled:
            if routed_shape is not None:
                raise UsageError(
                    "env.custom: routing replay (algorithm.routing_replay: rollout) is single-turn only"
                )
            self.group_requests = False  # each sample's turns are requests of their own
            self.env = Trajectories(
                env,
                tokenizer=tokenizer,
                stop_ids=(self.eos,) if self.eos is not None else (),
                decode=self._decode,
                max_model_tokens=max_new_tokens,
                on_error=self.fail,
            )

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        *,
        fleet: Fleet,
        pool: ScoringPool,
        sampler: PromptSampler,
        tokenizer: PreTrainedTokenizerBase,
        system_prompt: str,
        version: Callable[[], int],
    ) -> Rollouts:
        """Rollouts for a run: group size, sampling, seeds, reward and filter from ``cfg``;
        ``version``: the trainer's policy version (recorded per group at issue)."""
        return cls(
            fleet=fleet,
            pool=pool,
            sampler=sampler,
            tokenizer=tokenizer,
            reward=cfg.reward,
            group_size=cfg.loop.group_size,
            temperature=cfg.algorithm.temperature,
            top_p=cfg.loop.top_p,
            max_new_tokens=cfg.reward.l_max,
            seed=cfg.loop.seed,
            system_prompt=system_prompt,
            filter_tolerance=cfg.algorithm.filter_tolerance,
            stall_groups=cfg.loop.stall_groups(),
            version=version,
            group_requests=cfg.fleet.group_requests,
            routed_shape=routed_shape(cfg.model.hf) if cfg.algorithm.routing_replay == "rollout" else None,
            env=cfg.env,
        )

    # ------------------------------------------------------------------ counts (read-only)

    @property
    def in_flight(self) -> int:
        """Sequences generating now (issued, not yet returned by the fleet)."""
        with self._lock:
            return self._in_flight

    @property
    def outstanding(self) -> int:
        """Sequences issued whose score is not in yet (generating, or waiting for a verifier):
        what the async loop's ``n_async`` bounds, so a slow verifier throttles generation rather
        than growing a queue of unscored samples without end."""
        with self._lock:
            return self._unscored

    @property
    def length_ema(self) -> float:
        """Moving average of completion lengths (tokens; 0 before the first one)."""
        with self._lock:
            return self._length_ema

    @property
    def failed(self) -> bool:
        """Whether a callback met an error (:meth:`check` raises it)."""
        with self._lock:
            return bool(self._errors)

    def busy_seconds(self) -> float:
        """Wall time so far with at least one sequence in flight."""
        with self._lock:
            extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy_s + extra

    def max_prompt_len(self, default: int = 64) -> int:
        """The longest prompt rendered so far (``default`` before any)."""
        with self._lock:
            return self._max_prompt or default

    def capacity_tokens(self) -> int:
        """The fleet's KV capacity in tokens (0 when unknown)."""
        return self.fleet.capacity_tokens()

    def snapshot_stats(self) -> Counter[str]:
        """A copy of the counters, taken at one instant (missing keys read 0); with an
        environment, how its trajectories ended as ``env/<end>``."""
        with self._lock:
            out = Counter(self._stats)
        if self.env is not None:
            out.update({f"env/{k}": n for k, n in self.env.end_counts().items()})
        return out

    def pending_keys(self) -> list[tuple[str, int]]:
        """Prompts issued and neither trained nor dropped, in issue order."""
        with self._lock:
            return [r.key for r in sorted(self._pending.values(), key=lambda r: r.index)]

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint records: ``sampler`` (its cursor, the pending prompts first in its
        re-issue queue) and ``stats`` (the counters), read together under the lock."""
        with self._lock:
            return {
                "sampler": self.sampler.state_dict(pending=self.pending_keys()),
                "stats": dict(self._stats),
            }

    # ------------------------------------------------------------------ waiting

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float | None, *, outstanding_at_most: int | None = None
    ) -> bool:
        """Wait (at most ``timeout`` seconds) until ``predicate()`` holds; its last value.

        The predicate runs under the lock, woken by every change of the counts (a group issued,
        a sequence returned, a group finished, an error) and by :meth:`notify_all`. A sample
        scored wakes it only when :attr:`outstanding` is down to ``outstanding_at_most`` (the
        async loop's room for a group): one wake-up per group's worth of scores, not per sample;
        and a sequence returned wakes such a waiter only when none is left in flight."""
        with self._cond:
            if outstanding_at_most is None:
                self._plain_waiters += 1
                try:
                    return self._cond.wait_for(predicate, timeout)
                finally:
                    self._plain_waiters -= 1
            before, self._room_at = self._room_at, max(self._room_at, outstanding_at_most)
            try:
                return self._cond.wait_for(predicate, timeout)
            finally:
                self._room_at = before

    def notify_all(self) -> None:
        """Wake every :meth:`wait_until` (a caller's own state, read by its predicate, changed)."""
        with self._cond:
            self._cond.notify_all()

    def fail(self, e: BaseException) -> None:
        """Record an error that stops the run (raised by the next :meth:`check`)."""
        with self._cond:
            self._errors.append(e)
            self._cond.notify_all()

    def check(self) -> None:
        """Score samples whose scoring passed its deadline
        (:meth:`~megatron_rl.orchestration.scoring.Scorer.expire_overdue`), then raise the first
        error a callback met (a refused request, a dead fleet, a broken pool). Samples that found
        no live server are sent again first (parked again if there is still none)."""
        with self._lock:
            parked, self._parked = self._parked, []
        for rec, samples, exclude in parked:
            self._submit(rec, samples, exclude)
        self.scorer.expire_overdue()
        with self._lock:
            first = self._errors[0] if self._errors else None
            stalled = list(self._dropped_in_a_row) if self.stall_groups else []
        if isinstance(first, UserError):  # already one line that says why (a broken pool)
            raise first
        if first is not None:
            raise RuntimeError(f"rollouts failed: {first}") from first
        if stalled and len(stalled) >= self.stall_groups:
            raise NoProgressError(_no_progress(stalled))

    # ------------------------------------------------------------------ consuming

    def take_completed(self, timeout: float | None = None) -> GroupRecord | None:
        """The next kept group (it stays pending until retired), or None after ``timeout``."""
        try:
            return self._completed.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain_completed(self) -> list[GroupRecord]:
        """Every kept group waiting now, without waiting for more."""
        out = []
        while True:
            try:
                out.append(self._completed.get_nowait())
            except queue.Empty:
                return out

    def drain_dropped(self) -> list[GroupRecord]:
        """Groups the filter dropped since the last drain (each with its ``drop_reason``)."""
        with self._lock:
            out, self._dropped = self._dropped, []
        return out

    def stop(self) -> None:
        """The loop is over: cancel the scoring that has not started and ignore what comes back."""
        self.scorer.stop()
        if self.env is not None:
            self.env.close()
        self.notify_all()

    def retire(self, rec: GroupRecord) -> None:
        """The group was trained (or dropped by the trainer side): no longer pending."""
        with self._cond:
            self._forget(rec)
            self._cond.notify_all()

    def reissue(self, rec: GroupRecord, *, first: bool = False) -> None:
        """Retire ``rec`` and have the sampler issue its prompt again before any new one
        (``first``: ahead of the prompts already waiting to be re-issued); atomic for a
        concurrent :meth:`state_dict`."""
        with self._cond:
            self._forget(rec)
            self.sampler.requeue(rec.key, first=first)
            self._cond.notify_all()

    def _forget(self, rec: GroupRecord) -> None:
        # Only this record: the same prompt may be pending again under a newer record.
        if self._pending.get(rec.key) is rec:
            del self._pending[rec.key]

    # ------------------------------------------------------------------ prompts

    def render(self, problem: Problem) -> list[int]:
        """The prompt's token ids (rendered once per problem; a new list each call)."""
        with self._lock:
            cached = self._prompt_cache.get(problem.id)
            if cached is None:
                ids = render_prompt(self.tok, problem.problem, problem.task, system_prompt=self.system_prompt)
                self._prompt_cache[problem.id] = array.array("i", ids)
                self._max_prompt = max(self._max_prompt, len(ids))
                return ids
            return cached.tolist()

    # ------------------------------------------------------------------ issuing

    def issue_group(self, problem: Problem | None = None, epoch: int | None = None) -> GroupRecord:
        """Send the G requests of the sampler's next prompt (or of ``problem``)."""
        self._prepare(problem)
        with self._cond:
            if problem is None:
                problem, epoch = self.sampler.next()
            rec = GroupRecord(
                problem=problem,
                epoch=int(epoch or 0),
                index=next(self._index),
                prompt_ids=self.render(problem) if self.env is None else [],  # env: its resets'
                issued_version=self.version(),
                issued_at=time.monotonic(),
                results=[None] * self.group_size,
                scored=[None] * self.group_size,
                remaining=self.group_size,
            )
            self._pending[rec.key] = rec
            if self._in_flight == 0:
                self._busy_since = rec.issued_at
            self._in_flight += self.group_size
            self._unscored += self.group_size
            self._stats["groups_issued"] += 1
            self._cond.notify_all()
        if self.env is None:
            self._submit(rec, list(range(self.group_size)))
            return rec
        if rec.record is None:
            rec.record = problem.to_json()
        for i in range(self.group_size):  # each from its environment's reset, when that is back
            self.env.start(
                rec,
                i,
                on_ready=functools.partial(self._submit, rec, [i]),
                on_end=functools.partial(self._trajectory_done, rec, i),
            )
        return rec

    def _prepare(self, problem: Problem | None) -> None:
        """One-off verifier set-up (a precompiled C++ header: seconds) for every code language
        of the prompts, before the first is sent: here, not on the fleet's I/O thread, where
        completions are scored."""
        if self._prepared is not None and (problem is None or problem.task != "code"):
            return
        known: dict[str | None, Problem] = {}
        problems = getattr(self.sampler, "problems", {})  # PromptSampler: id -> problem
        for p in [*(problems.values() if self._prepared is None else ()), *([problem] if problem else [])]:
            if p.task == "code":
                known.setdefault(p.language, p)
        prepared = self._prepared or set()
        for language, p in known.items():
            if language not in prepared:
                prepare_verifiers([reward_input(p, "")], self.reward)
                prepared.add(language)
        self._prepared = prepared

    def _request(self, rec: GroupRecord, i: int) -> GenRequest:
        ids, max_new, turn = rec.prompt_ids, self.max_new_tokens, 0
        if self.env is not None:  # the trajectory's next model turn, from its own ids
            ids, max_new, turn = self.env.request(rec, i)
        return GenRequest(
            request_id=f"{rec.prompt_id}#{rec.index}.{i}" + (f"/{turn}" if turn else ""),
            input_ids=ids,
            max_new_tokens=max_new,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=request_seed(self.seed, rec.problem.id, rec.epoch, i) ^ turn,
            stop_token_ids=(self.eos,) if self.eos is not None else (),
            return_routed_experts=self.routed_shape is not None,
        )

    def _submit(self, rec: GroupRecord, samples: list[int], exclude: frozenset[str] = frozenset()) -> None:
        """Send samples ``samples`` of ``rec`` (a whole group, or the samples being re-sent): to
        one server in one request (``group_requests``), or one request each. Each comes back
        through :meth:`_on_results` as it finishes (where the server streams a group's
        samples) or with its request's others."""
        batches = [samples] if self.group_requests else [[i] for i in samples]
        for batch in batches:
            reqs = [self._request(rec, i) for i in batch]
            index = {r.request_id: i for r, i in zip(reqs, batch)}
            handed: set[int] = set()  # samples of this request handed back (lost ones are not)
            try:
                fut = self.fleet.submit_batch(
                    reqs,
                    exclude=set(exclude),
                    on_results=functools.partial(self._on_results, rec, index, handed, exclude),
                )
            except ServerLost:  # no live server at all: wait for one (check() sends it again)
                with self._lock:
                    self._parked.append((rec, batch, exclude))
                continue
            except ClientClosed as e:  # the run is stopping
                self.fail(e)
                return
            fut.add_done_callback(functools.partial(self._on_request_done, rec, batch, handed, exclude))

    # ------------------------------------------------------------------ callbacks

    def _on_request_done(
        self, rec: GroupRecord, samples: list[int], handed: set[int], exclude: frozenset[str], fut: Future
    ) -> None:
        """A request of ``rec`` ended (after every result it handed back): re-send the samples
        its lost server took with it, or stop the run on a refusal."""
        try:
            fut.result()
        except ServerLost as e:
            lost = [i for i in samples if i not in handed]
            with self._lock:
                rec.lost += len(lost)
                self._stats["requests_lost"] += len(lost)
            if lost:
                self._submit(rec, lost, exclude | {e.url})  # re-issue elsewhere, same seeds
        except BaseException as e:  # noqa: BLE001 - a refused request stops the run, with why
            self.fail(e)

    def _on_results(
        self,
        rec: GroupRecord,
        index: dict[str, int],
        handed: set[int],
        exclude: frozenset[str],
        results: list[GenResult],
    ) -> None:
        """Samples of ``rec`` came back (``index``: request id -> sample): re-send what was
        aborted or timed out for the first time; score the rest."""
        done: list[tuple[int, GenResult]] = []
        again: dict[str, list[int]] = {}  # timed out once: sent again away from this server
        resend: list[int] = []  # aborted (abort pause, /abort_request): sent again
        with self._lock:
            for result in results:
                i = index[result.request_id]
                handed.add(i)
                if result.meta.get("timed_out"):
                    if not rec.timed_out:
                        rec.timed_out = [0] * self.group_size
                    rec.timed_out[i] += 1
                    self._stats["requests_timed_out"] += 1
                    if rec.timed_out[i] == 1:
                        again.setdefault(result.server, []).append(i)
                        continue
                elif result.finish_reason == "abort":
                    self._stats["requests_aborted"] += 1
                    resend.append(i)
                    continue
                done.append((i, result))
        for server, idx in again.items():  # once more, elsewhere if there is another server
            self._submit(rec, idx, exclude | {server})
        if resend:
            self._submit(rec, resend, exclude)
        if self.routed_shape is not None:  # a generator without the experts stops the run, saying why
            try:
                for _, result in done:
                    routed_experts(result, self.routed_shape)
            except ValueError as e:
                self.fail(UsageError(str(e)))
                return
        if done and self.env is not None:
            for i, result in done:
                self.env.turn(
                    rec,
                    i,
                    result,
                    on_next=functools.partial(self._submit, rec, [i], exclude),
                    on_end=functools.partial(self._trajectory_done, rec, i),
                )
        elif done:
            self._generated(rec, done)

    def _trajectory_done(self, rec: GroupRecord, i: int) -> None:
        """Sample ``i``'s trajectory has ended: scored as one result (its environment's terms
        added to the reward by :meth:`_score`)."""
        assert self.env is not None

        def scored(result: GenResult, text: str, terms: dict[str, float]) -> None:
            with self._lock:
                if not rec.prompt_ids:  # the group's prompt in its records: its first trajectory's
                    rec.prompt_ids = list(result.prompt_ids)
                if terms:
                    rec.env_terms[i] = terms
            self._generated(rec, [(i, result)], [text])

        self.env.finish(rec, i, scored)

    def _generated(
        self, rec: GroupRecord, done: list[tuple[int, GenResult]], texts: list[str] | None = None
    ) -> None:
        """Samples of ``rec`` came back whole (or timed out twice): count them and send them to
        the verifier pool together, each with its deadline (``texts``: what the verifiers read,
        when not the decoded tokens: a trajectory's last model turn)."""
        with self._cond:
            for i, result in done:
                n = result.model_tokens
                rec.results[i] = result
                self._length_ema = n if not self._length_ema else 0.95 * self._length_ema + 0.05 * n
                self._stats["generated_tokens"] += n
                self._stats["prompt_tokens"] += len(result.prompt_ids)
                self._stats["prefix_cached_tokens"] += int(result.meta.get("cached_tokens") or 0)
            self._in_flight -= len(done)
            self._stats["completions"] += len(done)
            if self._in_flight == 0 and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
            if self._plain_waiters or self._in_flight == 0:  # the room waiter counts scores
                self._cond.notify_all()
        if texts is None:
            texts = [self._decode(r.token_ids) for _, r in done]
        self.scorer.submit(rec, done, texts, self.reward)

    def _score(self, rec: GroupRecord, i: int, r: GenResult, text: str, res: RewardResult) -> None:
        """Sample ``i`` of ``rec`` (generated as ``r``, decoded as ``text``) has its score ``res``."""
        scored = rec.scored_completion(i, r, text, res, routed_shape=self.routed_shape)
        terms = rec.env_terms.get(i)
        if terms:  # the environment's own reward terms, beside the reward stack's
            scored.reward += sum(terms.values())
            scored.parts.update({f"env/{k}": v for k, v in terms.items()})
        with self._cond:
            self._stats[f"reason/{res.reason}"] += 1
            self._unscored -= 1
            rec.scored[i] = scored
            rec.remaining -= 1
            last = rec.remaining == 0
            if self._unscored <= self._room_at:  # the async loop's room for one more group
                self._cond.notify_all()
        if last:
            self._group_done(rec)

    def _group_done(self, rec: GroupRecord) -> None:
        # Every sample is scored: no other callback touches rec.scored any more.
        scored = rec.all_scored()
        reason = group_drop_reason(
            [s.reward for s in scored],
            tolerance=self.filter_tolerance,
            correct=[bool(s.correct) for s in scored],
            format_ok=[bool(s.format_ok) for s in scored],
        )
        solved = all(s.correct for s in scored)
        with self._cond:
            rec.done_at = time.monotonic()
            rec.kept = reason is None
            if solved:
                self.sampler.mark_solved(rec.problem.id)
            if rec.kept:
                self._completed.put(rec)
                self._dropped_in_a_row.clear()
            else:
                rec.drop_reason = reason or ""
                self._dropped.append(rec)
                self._dropped_in_a_row.append(rec)
                del self._dropped_in_a_row[: -max(self.stall_groups, 1)]
                self._forget(rec)
            self._cond.notify_all()


def _no_progress(groups: list[GroupRecord]) -> str:
    """Why the last ``groups`` (all dropped) mean no batch can fill, for the error message."""
    drops = Counter(g.drop_reason for g in groups)
    reasons = Counter(s.reason for g in groups for s in g.all_scored())
    rewards = Counter(round(s.reward, 3) + 0.0 for g in groups for s in g.all_scored())  # no -0.0
    fmt = lambda c: ", ".join(f"{'-' if k == '' else k}: {n}" for k, n in c.most_common(5))
    return (
        f"no progress: the last {len(groups)} groups were all dropped ({fmt(drops)}); their "
        f"samples' verifier reasons: {fmt(reasons)}; rewards: {fmt(rewards)}. Every group's "
        "rewards are equal, so no batch can fill: check the data (missing or wrong answers), the "
        "reward, and the sampling temperature (loop.max_dropped_batches sets when this stops a run)"
    )
