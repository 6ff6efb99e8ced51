"""The GRPO loop: asynchronous as in Magistral (generators never wait), synchronous, or
colocated (trainer and generators take turns on the same devices).

**Async** (``loop.mode: async``). A generation thread keeps issuing groups of G requests while
fewer than ``n_async`` sequences are generating (``n_async`` also capped at ``max_async_ratio *
n_batch`` and at the fleet's KV capacity divided by the expected sequence length, recomputed from
the lengths seen so far) and the bounded queue of verified groups is not full. Completions are
scored as they finish; kept groups go to that queue (an assembler thread's blocking ``put``: a
full queue stops generation from issuing more, so a slow trainer throttles the fleet). The
trainer takes whole groups until it has ``n_batch`` sequences (dropping and re-issuing those
older than ``max_staleness`` versions, when a bound is set), trains ``n_batch / n_minibatch`` optimizer steps, and broadcasts the
new weights to the fleet *in flight*: running sequences keep their KV cache and later tokens
carry the new version (the built-in engine decodes while it receives and swaps the weights in
between two steps; SGLang pauses in place for the transfer, ``weight_sync.pause_mode``).

**Sync** (``loop.mode: sync``). Generate until ``n_batch`` sequences of kept groups exist, train,
update, repeat; the fleet idles while the trainer works. Surplus kept groups are re-issued next
step (so a batch is always on-policy and the same run replays identically from a checkpoint).

**Colocated** (``loop.mode: colocated``, one node: the trainer and the engine share its GPUs, or
its cores here). A sync step whose fleet gives its memory back while the trainer works: generate
a batch, ``/release_memory_occupation`` (KV cache, weights, CUDA graphs), train, then the weight
update resumes the weights, writes the new ones by reference (``/update_weights_from_tensor``,
no update group) and resumes the KV cache (``weight_sync/colocated.py``).

**Every wait ends.** The generation thread issues a group only while fewer than ``n_async``
sequences are *outstanding* (generating or waiting for a verifier), so a slow reward throttles
generation instead of piling up samples to score; every sample gets a score by its deadline
(:meth:`Rollouts.check`, called by each wait); and with a ``deadline`` (``run.time_limit_min``)
a step still waiting for its batch past it is abandoned on every rank (:class:`TimeLimitReached`):
its groups stay pending, so the checkpoint taken then re-issues them on resume. :meth:`stop`
cancels the scoring that has not started.

Collective over the trainer's ranks: rank 0 orchestrates (fleet, verifier pool, sampler,
metrics, run directory) and sends each minibatch to the other ranks; every rank runs the
optimizer steps, the weight broadcast and the checkpoints.
"""

from __future__ import annotations

import gc
import itertools
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.batching.builder import build_train_batch

if TYPE_CHECKING:
    from megatron_rl.orchestration.group_record import GroupRecord
    from megatron_rl.orchestration.recipe import RunConfig
    from megatron_rl.orchestration.rollouts import Rollouts
    from megatron_rl.types import TrainBatch

__all__ = [
    "Broadcaster",
    "Orchestrator",
    "StepResult",
    "TimeLimitReached",
    "Trainer",
    "staleness_stats",
    "train_stats",
]

_T = TypeVar("_T")
# What rank 0 broadcasts in place of a step's minibatch count while it waits for its batch and
# the fleet needs the trainer's weights first (-1: the time limit or a preemption stopped it).
_RESYNC = -2


class Trainer(Protocol):
    """What the loop needs of the trainer: a :class:`~megatron_rl.training.trainer.PolicyTrainer`,
    or a stand-in (a benchmark's modelled trainer)."""

    @property
    def step(self) -> int:
        """Optimizer steps taken: the policy version of the current weights."""
        ...

    def rl_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch`` (collective over the trainer's ranks); its stats."""
        ...


class Broadcaster(Protocol):
    """What the loop needs of the weight update: a
    :class:`~megatron_rl.weight_sync.broadcast.WeightBroadcaster`, or a stand-in. A colocated
    loop needs a :class:`~megatron_rl.weight_sync.colocated.TensorPusher`: one with a
    ``release()`` too, whose ``sync`` gives the fleet its memory back."""

    def sync(self, version: int) -> dict[str, float]:
        """Send the trainer's weights to the fleet as policy ``version``; its timings."""
        ...


def staleness_stats(versions: list[tuple[int, list[int]]]) -> dict[str, float]:
    """Per trained token, how many policy versions behind the weights that trained it it was
    generated (``versions``: per completion, the version of the weights that train it and its
    tokens' versions): mean, p95, max, the token count and a histogram (fractions)."""
    if not versions:
        return {}
    # One tensor from all the lists at once: a tensor per completion cost more than the tokens.
    current = torch.repeat_interleave(
        torch.tensor([v for v, _ in versions], dtype=torch.long),
        torch.tensor([len(toks) for _, toks in versions], dtype=torch.long),
    )
    made = torch.tensor(list(itertools.chain.from_iterable(toks for _, toks in versions)), dtype=torch.long)
    lag = (current - made).clamp(min=0)
    if not lag.numel():
        return {}
    out = {
        "staleness/mean": float(lag.float().mean()),
        # The smallest lag at or above 95% of the tokens (kthvalue: no size limit, unlike quantile).
        "staleness/p95": float(torch.kthvalue(lag, max(1, math.ceil(0.95 * lag.numel()))).values),
        "staleness/max": float(lag.max()),
        "staleness/tokens": float(lag.numel()),
    }
    for k, n in zip(*torch.unique(lag, return_counts=True)):
        out[f"staleness/hist/{int(k)}"] = float(n) / lag.numel()
    return out


# The trainer's per-optimizer-step stats reported as train/*: the mean over a step's optimizer
# steps, the maximum for *_max.
_TRAIN_STATS = (
    "loss",
    "grad_norm",
    "lr",
    "entropy_mean",
    "clip_low_frac",
    "clip_high_frac",
    "ratio_mean",
    "ratio_max",
    "approx_kl_mean",
    "behaviour_weight_mean",  # decoupled objective: proximal / behaviour of the tokens kept
    "behaviour_capped_mean",  # decoupled objective: tokens left out by the cap, per token kept
    "tokens_per_s",
    "step_time_s",
)


def train_stats(stats_list: list[dict[str, float]]) -> dict[str, float]:
    """``train/*`` of one step from its optimizer steps' stats (``rl_step``'s dicts, in order)."""
    out: dict[str, float] = {}
    for key in _TRAIN_STATS:
        vals = [s[key] for s in stats_list if key in s]
        if vals:
            out[f"train/{key}"] = (
                float(sum(vals) / len(vals)) if not key.endswith("_max") else float(max(vals))
            )
    out["train/optimizer_steps"] = float(len([s for s in stats_list if not s.get("skipped")]))
    # Optimizer steps skipped for a non-finite loss or gradient norm: in this step, and in the run.
    out["train/skipped_steps"] = float(sum(bool(s.get("skipped")) for s in stats_list))
    if any("nonfinite_steps" in s for s in stats_list):
        out["train/nonfinite_steps"] = float(max(s.get("nonfinite_steps", 0) for s in stats_list))
    return out


class TimeLimitReached(Exception):
    """The run's deadline passed while a step waited for its batch (on every rank: rank 0 tells
    the others); the step was not trained."""


@dataclass
class StepResult:
    step: int
    metrics: dict[str, float]
    groups: list[GroupRecord]


# Container allocations between two young collections of the cyclic GC while the async loop
# runs (CPython's default: 700). Every completion allocates a list per token (the reply's
# [logprob, token, text] triples), so at the default the collector ran ~50 times a second and
# rescanned every survivor: perf measured 12% of the orchestrator's CPU in it at 16 servers x
# 256 slots. The loop's objects rarely form cycles; memory stays bounded by the same collections,
# run less often.
_GC_YOUNG = 50_000


class Orchestrator:
    """Drives :class:`Rollouts` and the trainer; see the module docstring.

    ``trainer``: a :class:`~megatron_rl.training.trainer.PolicyTrainer` (or anything with
    ``rl_step(batch)`` and ``step``: :class:`Trainer`); ``broadcaster``: a
    :class:`~megatron_rl.weight_sync.broadcast.WeightBroadcaster` (or None: no fleet update);
    ``rollouts``: rank 0's :class:`Rollouts` (None on other ranks).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        trainer: Trainer,
        broadcaster: Broadcaster | None,
        rollouts: Rollouts | None,
        rank: int = 0,
        world_size: int = 1,
        sync_weights: bool = True,
    ):
        self.cfg = cfg  # RunConfig
        self.trainer, self.broadcaster, self.rollouts = trainer, broadcaster, rollouts
        self.rank, self.world_size = rank, world_size
        self.sync_weights = sync_weights
        self.loop = cfg.loop
        self.queue: queue.Queue[GroupRecord] = queue.Queue(maxsize=self.loop.queue_capacity())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._gc_threshold: tuple[int, ...] | None = None  # the GC settings start() replaced
        self.queue_blocked_s = 0.0
        self.queue_blocks = 0
        self._t_start = time.monotonic()
        self._last = {"t": time.monotonic(), "tokens": 0, "busy": 0.0, "completions": 0}
        self.last_dropped: list[GroupRecord] = []
        # time.monotonic() past which a step waiting for its batch is abandoned (rank 0; the run
        # sets it from run.time_limit_min); None: no limit.
        self.deadline: float | None = None
        # Rank 0: whether the fleet's servers are all held, waiting for the trainer's weights
        # (orchestration/fleet_health.py): a step waiting for its batch then runs a weight update
        # (with every rank) so that they generate again. None: never.
        self.resync_due: Callable[[], bool] | None = None

    def _rank0_rollouts(self) -> Rollouts:
        """The rollouts, for the methods only rank 0 runs (generation, batches, metrics): the
        other ranks hold none, and the run builds them on rank 0 before the first step."""
        if self.rollouts is None:
            raise RuntimeError(
                f"Orchestrator: rank {self.rank} holds no rollouts; only rank 0 generates, "
                "takes batches and computes metrics"
            )
        return self.rollouts

    # ------------------------------------------------------------------ capacity

    def async_cap(self) -> int:
        """Sequences allowed to generate at once: the config cap and the fleet's KV capacity."""
        cap = self.loop.async_cap()
        r = self.rollouts
        if r is not None:
            prompt = r.max_prompt_len(default=64)
            expected = r.length_ema or self.loop.expected_length or r.max_new_tokens / 2
            kv = r.capacity_tokens()
            if kv > 0:
                cap = min(cap, int(kv // max(1.0, prompt + expected)))
        g = self.loop.group_size
        return max(g, cap - cap % g)

    # ------------------------------------------------------------------ async threads

    def start(self) -> None:
        """Rank 0 in async mode: start generating (returns at once). The process's cyclic
        garbage collector is tuned until :meth:`stop` (see ``_GC_YOUNG``)."""
        if self.rollouts is None or self.loop.mode != "async" or self._threads:
            return
        self._gc_threshold = gc.get_threshold()
        gc.freeze()  # the start-up heap (model, tokenizer, problems) is never garbage: out of every scan
        gc.set_threshold(_GC_YOUNG, *self._gc_threshold[1:])
        for target, name in ((self._generate_forever, "generate"), (self._assemble_forever, "assemble")):
            t = threading.Thread(target=target, name=f"rl-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop generating and cancel the scoring not yet started (nobody trains it now)."""
        self._stop.set()
        if self.rollouts is not None:
            self.rollouts.stop()
        for t in self._threads:
            t.join(timeout=10)  # each loop wakes every 0.05 s to look at the stop flag
        self._threads = []
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
            gc.unfreeze()
            self._gc_threshold = None

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeLimitReached
        if self.resync_due is not None and self.resync_due():
            self._resync()

    def _resync(self) -> None:
        """Rank 0, waiting for its batch: every rank runs the weight update of the current
        version now (the others wait in :meth:`step` for rank 0's word)."""
        self.broadcast_object(_RESYNC)
        if self.sync_weights and self.broadcaster is not None:
            self.broadcaster.sync(int(self.trainer.step))

    def busy_seconds(self) -> float:
        """Wall time the generators had work (a sequence in flight), as Rollouts counts it."""
        return self.rollouts.busy_seconds() if self.rollouts is not None else 0.0

    def _generate_forever(self) -> None:
        r, g = self._rank0_rollouts(), self.loop.group_size
        # Room for one more group: no error, the cap not reached, the verified queue not full
        # (the assembler's notify_all wakes this when the trainer takes a group).
        room = lambda: not r.failed and r.outstanding + g <= self.async_cap() and not self.queue.full()
        while not self._stop.is_set():
            if (
                not r.wait_until(room, timeout=0.02, outstanding_at_most=self.async_cap() - g)
                or self._stop.is_set()
            ):
                continue
            try:
                r.issue_group()
            except BaseException as e:  # noqa: BLE001 - surfaced by the trainer thread
                r.fail(e)
                return

    def _assemble_forever(self) -> None:
        r = self._rank0_rollouts()
        while not self._stop.is_set():
            rec = r.take_completed(timeout=0.05)
            if rec is None:
                continue
            t0 = time.monotonic()
            blocked = False
            while not self._stop.is_set():
                try:
                    self.queue.put(rec, timeout=0.05)
                    break
                except queue.Full:
                    blocked = True
            if blocked:
                self.queue_blocks += 1
                self.queue_blocked_s += time.monotonic() - t0
            r.notify_all()  # the queue has room again, maybe

    # ------------------------------------------------------------------ batches (rank 0)

    def _take_async(self, n: int, version: int) -> tuple[list[GroupRecord], list[GroupRecord]]:
        """Whole groups until ``n`` sequences; stale groups are set aside (re-issued)."""
        r, bound = self._rank0_rollouts(), self.loop.staleness_bound()
        taken: list[GroupRecord] = []
        stale: list[GroupRecord] = []
        count = 0
        while count < n:
            r.check()
            self._check_deadline()
            try:
                rec = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if bound is not None and rec.staleness(version) > bound:
                stale.append(rec)
                continue
            taken.append(rec)
            count += len(rec.scored)
        return taken, stale

    def _take_sync(self, n: int) -> list[GroupRecord]:
        """Generate until ``n`` sequences of kept groups exist (waves of at most the async cap);
        the first ``n / G`` kept in issue order are the batch, the rest are re-issued."""
        r, g = self._rank0_rollouts(), self.loop.group_size
        kept: list[GroupRecord] = []
        while len(kept) * g < n:
            # The configured cap only (not the KV estimate, which depends on lengths seen so
            # far): a resumed run must issue the same waves as an uninterrupted one.
            wave = min(self.loop.async_cap(), n - len(kept) * g)
            recs = [r.issue_group() for _ in range(-(-wave // g))]
            # In slices: each one scores overdue samples (check) and looks at the deadline.
            while not r.wait_until(partial(self._settled, recs), timeout=1.0):
                r.check()
                self._check_deadline()
            r.check()
            kept.extend(r.drain_completed())
        kept.sort(key=lambda x: x.index)
        take = n // g
        for rec in kept[take:]:  # surplus: re-issued first next step, under the new weights
            r.reissue(rec, first=True)
        return kept[:take]

    def _settled(self, recs: list[GroupRecord]) -> bool:
        """Every group of a sync wave scored and filtered (or a callback failed)."""
        r = self._rank0_rollouts()
        return r.failed or (r.in_flight == 0 and all(x.kept is not None for x in recs))

    # ------------------------------------------------------------------ one step (collective)

    def step(self) -> StepResult:
        """One training step: a batch, its optimizer steps, the weight broadcast (collective)."""
        n_batch, n_mini = self.loop.n_batch, self.loop.minibatch
        version = int(self.trainer.step)
        groups: list[GroupRecord] = []
        stale: list[GroupRecord] = []
        r = self._rank0_rollouts() if self.rank == 0 else None
        t0 = time.monotonic()
        timed_out = False
        if r is not None:
            try:
                if self.loop.mode == "async":
                    groups, stale = self._take_async(n_batch, version)
                else:
                    groups = self._take_sync(n_batch)
            except TimeLimitReached:  # the groups taken stay pending: re-issued on resume
                timed_out = True
            for rec in stale:
                r.reissue(rec)
        t_wait = time.monotonic() - t0
        per_mini = n_mini // self.loop.group_size
        chunks = [groups[i : i + per_mini] for i in range(0, len(groups), per_mini)]
        n_chunks = self.broadcast_object(-1 if timed_out else len(chunks))  # -1: every rank stops
        while n_chunks == _RESYNC:  # not rank 0: rank 0 waits for a fleet that needs the weights
            if self.sync_weights and self.broadcaster is not None:
                self.broadcaster.sync(version)
            n_chunks = self.broadcast_object(-1)
        if n_chunks < 0:
            raise TimeLimitReached
        release_stats = self._release_fleet()
        stats_list: list[dict[str, float]] = []
        # Minibatch i is trained by the weights of version + i: its tokens' lag counts from there.
        versions = [  # the model's tokens: a trajectory's environment turns have no version (-1)
            (version + i, [v for v in s.completion.versions if v >= 0])
            for i, c in enumerate(chunks)
            for rec in c
            for s in rec.all_scored()
        ]
        batches = [
            self.broadcast_object(  # built on rank 0, sent to the others
                build_train_batch([g.to_group() for g in chunks[i]], self.cfg.algorithm)
                if self.rank == 0
                else None
            )
            for i in range(n_chunks)
        ]
        if any(b is None for b in batches):
            raise RuntimeError(f"Orchestrator: rank {self.rank} got no minibatch from rank 0")
        if self.cfg.algorithm.objective == "decoupled":
            self._attach_proximal(batches[1:])  # the first is trained by the proximal weights themselves
        for batch in batches:
            assert batch is not None  # checked above
            stats_list.append(self.trainer.rl_step(batch))
        t_train = time.monotonic() - t0 - t_wait
        new_version = int(self.trainer.step)
        sync_stats: dict[str, float] = dict(release_stats)
        if self.sync_weights and self.broadcaster is not None:
            sync_stats.update(self.broadcaster.sync(new_version))  # colocated: resumes the fleet too
        if r is None:  # not rank 0: no batch of its own, no metrics
            return StepResult(new_version, {}, [])
        for rec in groups:
            r.retire(rec)
        metrics = self._metrics(
            groups, stale, stats_list, versions, version, new_version, t_wait, t_train, sync_stats
        )
        return StepResult(new_version, metrics, groups)

    def _attach_proximal(self, batches: list[TrainBatch | None]) -> None:
        """Decoupled objective, several minibatches a step: each later minibatch's log-probs under
        the step's starting weights, computed before its first optimizer step (collective)."""
        compute = getattr(self.trainer, "compute_logprobs", None)
        for batch in batches:
            if batch is None or not len(batch):
                continue
            if compute is None:
                raise TypeError(
                    f"algorithm.objective: decoupled with several minibatches a step needs a trainer that "
                    f"computes log-probs, got {type(self.trainer).__name__}"
                )
            for seq, logp in zip(batch.sequences, compute(batch)):
                seq.proximal_logprobs = logp

    def _release_fleet(self) -> dict[str, float]:
        """Colocated mode: the fleet frees its memory before the trainer runs (the broadcaster's
        next ``sync`` takes it back); every other mode keeps it."""
        if self.loop.mode != "colocated" or not self.sync_weights or self.broadcaster is None:
            return {}
        release = getattr(self.broadcaster, "release", None)
        if release is None:
            raise TypeError(
                f"loop.mode: colocated needs a weight update that can release the fleet's memory "
                f"(weight_sync.colocated.TensorPusher), got {type(self.broadcaster).__name__}"
            )
        stats: dict[str, float] = release()
        return stats

    def broadcast_object(self, obj: _T) -> _T:
        """``obj`` from rank 0 on every trainer rank (pickled; a no-op on one rank)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ metrics (rank 0)

    def _metrics(
        self,
        groups: list[GroupRecord],
        stale: list[GroupRecord],
        stats_list: list[dict[str, float]],
        versions: list[tuple[int, list[int]]],
        version: int,
        new_version: int,
        t_wait: float,
        t_train: float,
        sync_stats: dict[str, float],
    ) -> dict[str, float]:
        r = self._rank0_rollouts()
        scored = [s for rec in groups for s in rec.all_scored()]
        m: dict[str, float] = {"step": float(new_version), "version/trained_from": float(version)}
        if scored:
            rewards = torch.tensor([s.reward for s in scored])
            lengths = torch.tensor([float(s.completion.model_tokens) for s in scored])
            m.update(
                {
                    "reward/mean": float(rewards.mean()),
                    "reward/std": float(rewards.std()),
                    "pass_rate": sum(bool(s.correct) for s in scored) / len(scored),
                    "format_rate": sum(bool(s.format_ok) for s in scored) / len(scored),
                    "length/mean": float(lengths.mean()),
                    "length/max": float(lengths.max()),
                    "length/truncated": sum(s.completion.finish_reason == "length" for s in scored)
                    / len(scored),
                    "sequences": float(len(scored)),
                    "groups/trained": float(len(groups)),
                }
            )
            for part in ("format", "correct", "custom", "length", "language"):
                if part == "custom" and not any("custom" in s.parts for s in scored):
                    continue
                m[f"reward/{part}"] = sum(s.parts.get(part, 0.0) for s in scored) / len(scored)
            for part in sorted({p for s in scored for p in s.parts if p.startswith("env/")}):
                m[f"reward/{part}"] = sum(s.parts.get(part, 0.0) for s in scored) / len(
                    scored
                )  # an environment's terms
        m.update(train_stats(stats_list))
        m.update(staleness_stats(versions))
        dropped = r.drain_dropped()
        self.last_dropped = dropped
        reasons = Counter(rec.drop_reason for rec in dropped)
        reasons.update({"stale": len(stale)})
        for reason, n in reasons.items():
            m[f"groups/dropped/{reason}"] = float(n)
        m["groups/dropped"] = float(sum(reasons.values()))
        m["queue/depth"] = float(self.queue.qsize())
        m["queue/blocked_s"] = self.queue_blocked_s
        m["queue/blocks"] = float(self.queue_blocks)
        m["in_flight"] = float(r.in_flight)
        m["async_cap"] = float(self.async_cap())
        now = time.monotonic()
        dt = max(now - self._last["t"], 1e-9)
        busy = self.busy_seconds()
        stats = r.snapshot_stats()
        m["generator/busy_fraction"] = min(1.0, (busy - self._last["busy"]) / dt)
        m["throughput/generated_tokens_per_s"] = (stats["generated_tokens"] - self._last["tokens"]) / dt
        m["throughput/completions_per_s"] = (stats["completions"] - self._last["completions"]) / dt
        # Prompt tokens SGLang served from its prefix cache since the last step: their KV may be
        # of older weights (weight_sync.prefix_cache: keep); 0 with the built-in engine.
        prompt = stats["prompt_tokens"] - self._last.get("prompt", 0)
        cached = stats["prefix_cached_tokens"] - self._last.get("cached", 0)
        m["generator/prefix_cached_fraction"] = cached / prompt if prompt else 0.0
        m["throughput/train_tokens_per_s"] = sum(
            len(s.completion.token_ids) + len(rec.prompt_ids) for rec in groups for s in rec.all_scored()
        ) / max(t_train, 1e-9)
        m["time/wait_for_batch_s"] = t_wait
        m["time/train_s"] = t_train
        m["time/step_s"] = dt
        m["requests/lost"] = float(stats["requests_lost"])
        # Why each sample of the step (trained or dropped) scored as it did: timeouts, verifier
        # errors, custom labels, counted per reason.
        for reason, n in Counter(s.reason for rec in (*groups, *dropped) for s in rec.all_scored()).items():
            m[f"samples/reason/{reason}"] = float(n)
        # How the multi-turn trajectories ended (env/done, env/max_turns, env/env_timeout, ...),
        # counted since the start of this invocation.
        m.update({k: float(v) for k, v in stats.items() if k.startswith("env/")})
        for k, v in sync_stats.items():
            m[k] = float(v)
        self._last = {
            "t": now,
            "tokens": stats["generated_tokens"],
            "busy": busy,
            "completions": stats["completions"],
            "prompt": stats["prompt_tokens"],
            "cached": stats["prefix_cached_tokens"],
        }
        return m
