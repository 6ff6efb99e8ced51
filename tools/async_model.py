"""The cost model of ``megatron-rl bench async`` (``tools/bench_async.py``): its calibration on
this machine (the real engine's decode and prefill, the real trainer's step, measured warm), the
fleet sizing built on it, and :class:`IdealSchedule`, an exact event simulation of the sync and
async loops' schedules on that cost model with zero overhead (the bench's ideal wall times).

Here rather than in the bench so that the bench stays readable and the simulator is tested on
its own (``tests/orchestration/test_async_ideal.py``).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Costs", "IdealSchedule", "SimFleet", "SimTrainer", "calibrate", "ideal_schedule", "size_fleet"]


# ---------------------------------------------------------------------- calibration


@dataclass(kw_only=True)
class Costs:
    """The cost model (seconds), measured here or given; ``measured`` holds the raw medians."""

    decode_s: float
    decode_s_per_seq: float
    prefill_s_per_token: float
    train_s: float
    train_s_per_token: float
    measured: dict[str, object] = field(default_factory=dict)
    given: list[str] = field(default_factory=list)  # the costs taken from the command line


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` over ``points``, both >= 0 (``a`` 0 and ``b`` through the
    origin when the intercept would come out negative)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if b < 0:  # no growth measured: the mean is the cost
        return max(0.0, my), 0.0
    if a < 0:
        return 0.0, sum(x * y for x, y in points) / max(1e-12, sum(x * x for x in xs))
    return a, b


def calibrate_engine(init: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, object]:
    """The real engine on the tiny model, one thread as a server runs it: median decode step time
    at several running batches (fitted), and the prefill of one group's prompt per token."""
    import torch

    from megatron_rl.generation.engine.engine import Engine, EngineConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = Engine.from_pretrained(init, EngineConfig(max_slots=args.slots, max_len=args.max_len))
        sizes = sorted({1, max(1, args.slots // 4), max(1, args.slots // 2), args.slots})
        decode: dict[int, list[tuple[int, float]]] = {b: [] for b in sizes}
        rid = itertools.count()

        def fill(n: int, same_prompt: bool) -> list[str]:
            ids = [f"cal-{next(rid)}" for _ in range(n)]
            for i, r in enumerate(ids):
                eng.add_request(r, prompts[0 if same_prompt else i % len(prompts)], max_new_tokens=48, seed=i)
            return ids

        # Sizes up, then down: drift hits all sizes alike. Cheap, so twice the rounds.
        for rnd in range(2 * args.calib_rounds):
            for b in sizes if rnd % 2 == 0 else sizes[::-1]:
                ids = fill(b, same_prompt=False)
                eng.step()  # admission (prefill) and the first decode
                for _ in range(10):
                    n = eng.running
                    t0 = time.perf_counter()
                    eng.step()
                    decode[b].append((n, time.perf_counter() - t0))
                for r in ids:
                    eng.abort(r)
        points = [
            (statistics.median(n for n, _ in v), statistics.median(dt for _, dt in v))
            for v in decode.values()
        ]
        d, ds = _fit(points)
        # One group's share of a server: G / servers samples of one prompt, prefilled once.
        g = max(1, -(-args.group_size // args.servers))
        plen = len(prompts[0])
        extra = []
        for _ in range(3 * args.calib_rounds):
            ids = fill(g, same_prompt=True)
            t0 = time.perf_counter()
            eng.step()  # prefill [1, P] + a decode of g
            extra.append(time.perf_counter() - t0 - (d + ds * eng.running))
            for r in ids:
                eng.abort(r)
        return {
            "decode_s": d,
            "decode_s_per_seq": ds,
            "prefill_s_per_token": max(0.0, statistics.median(extra)) / plen,
            "decode_points": [(round(n, 1), round(1e3 * t, 3)) for n, t in points],  # (batch, ms)
            "prefill_ms": round(1e3 * max(0.0, statistics.median(extra)), 3),
            "prompt_tokens": plen,
        }
    finally:
        torch.set_num_threads(threads)


def calibrate_trainer(
    init: Path, prompts: list[list[int]], script: list[list[int]], args: argparse.Namespace
) -> dict[str, object]:
    """The real PolicyTrainer on the tiny model: median GRPO step time on batches of two sizes
    (script completions, mixed rewards), fitted to ``train_s + train_s_per_token * tokens``."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch
    from megatron_rl.quickstart.sft import make_trainer
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    # Groups of 4: the step's cost depends on its tokens, not on G; small batches keep this short.
    cfg, g = GRPOConfig(), 4
    rng = random.Random(args.seed + 1)
    prompt_ids = prompts[0]

    def batch(n_groups: int):
        groups = []
        for k in range(n_groups):
            comps = []
            for i in range(g):
                ids = rng.choice(script)[: args.l_max]
                c = Completion(
                    prompt_id=f"p{k}",
                    sample_index=i,
                    token_ids=ids,
                    logprobs=[-1.0] * len(ids),
                    versions=[0] * len(ids),
                )
                comps.append(ScoredCompletion(completion=c, reward=float(i % 2)))
            groups.append(Group(prompt=Prompt(prompt_id=f"p{k}", token_ids=prompt_ids), completions=comps))
        return build_train_batch(groups, cfg)

    trainer = make_trainer(init, lr=1e-6, grpo=cfg)
    try:
        batches = [batch(1), batch(2)]  # the same two batches every round: medians per size
        trainer.rl_step(batches[1])  # warm-up: first-call allocations
        times: list[list[float]] = [[], []]
        for rnd in range(args.calib_rounds):
            for k in (0, 1) if rnd % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                trainer.rl_step(batches[k])
                times[k].append(time.perf_counter() - t0)
        points = [(float(sum(b.lengths)), statistics.median(t)) for b, t in zip(batches, times)]
        a, b = _fit(points)
        return {
            "train_s": a,
            "train_s_per_token": b,
            "train_points": [(int(x), round(dt, 3)) for x, dt in points],  # (tokens, median s)
        }
    finally:
        trainer.close()


def calibrate(
    init: Path, prompts: list[list[int]], script: list[list[int]], args: argparse.Namespace
) -> Costs:
    """The cost model: each cost from the command line where given, else measured here."""
    names = ("decode_s", "decode_s_per_seq", "prefill_s_per_token", "train_s", "train_s_per_token")
    flags = dict(
        zip(
            names,
            ("decode_ms", "decode_ms_per_seq", "prefill_ms_per_token", "train_ms", "train_ms_per_token"),
        )
    )
    given = {n: getattr(args, flags[n]) / 1e3 for n in names if getattr(args, flags[n]) is not None}
    measured: dict[str, object] = {}
    if any(n not in given for n in names[:3]):
        t0 = time.perf_counter()
        measured.update(calibrate_engine(init, prompts, args))
        print(f"[calibrate] engine: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if any(n not in given for n in names[3:]):
        t0 = time.perf_counter()
        measured.update(calibrate_trainer(init, prompts, script, args))
        print(f"[calibrate] trainer: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    values = {n: float(given[n] if n in given else measured[n]) for n in names}  # type: ignore[arg-type]
    return Costs(**values, measured=measured, given=sorted(given))


def size_fleet(
    costs: Costs, lengths: list[int], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    """The trainer speed-up that makes training a batch take ``args.train_share`` of the fleet's
    time to generate it at full slots (or ``args.train_speedup`` as given), and the figures the
    choice rests on."""
    mean_len = statistics.fmean(lengths)
    plen = statistics.fmean(len(p) for p in prompts)
    step = costs.decode_s + costs.decode_s_per_seq * args.slots
    fleet_tok_s = args.servers * args.slots / step  # generated tokens per second at full slots
    groups = args.n_batch / args.group_size
    spread = 1 if getattr(args, "group_requests", "off") != "off" else min(args.group_size, args.servers)
    # A group's prompt is prefilled once on every server its samples reach.
    prefill = groups * spread * plen * costs.prefill_s_per_token / args.servers
    gen_s = args.n_batch * mean_len / fleet_tok_s + prefill
    train1_s = costs.train_s + costs.train_s_per_token * args.n_batch * (plen + mean_len)
    speedup = args.train_speedup or train1_s / (args.train_share * gen_s)
    return {
        "train_speedup": speedup,
        "gen_batch_s": gen_s,  # the fleet's time to generate a batch at full slots
        "train_batch_s_measured": train1_s,  # this machine's trainer on a batch
        "train_batch_s": train1_s / speedup,  # the modeled trainer on a batch
        "servers_per_trainer": args.servers / speedup,  # per measured trainer
        "fleet_tokens_per_s": fleet_tok_s,
    }


# ---------------------------------------------------------------------- the ideal schedule


@dataclass(kw_only=True)
class SimFleet:
    """The fleet of the cost model: ``servers`` engines of ``slots`` slots and ``kv_tokens`` KV
    tokens each, whose steps cost what a :class:`TimingEngine` step sleeps."""

    servers: int
    slots: int
    kv_tokens: int
    decode_s: float
    decode_s_per_seq: float
    prefill_s_per_token: float


@dataclass(kw_only=True)
class SimTrainer:
    """An optimizer step costs ``train_s + train_s_per_token * tokens``; a weight update takes
    ``sync_s``. ``pause``: the fleet pauses for it once the steps in progress end (SGLang's
    update, ``weight_sync.pause_mode: in_place``); else it decodes through it and each server
    swaps the new weights in when its step in progress ends (the built-in engine's streamed
    update), which is when the trainer goes on."""

    train_s: float
    train_s_per_token: float
    sync_s: float
    pause: bool = True


class _Req:
    __slots__ = ("group", "length", "seed", "version", "written")

    def __init__(self, group: _Grp, seed: int, length: int):
        self.group, self.seed, self.length, self.written, self.version = group, seed, length, 0, -1


@dataclass
class _Grp:
    index: int
    key: tuple[str, int]
    prompt: tuple[int, ...]
    reqs: list[_Req]
    done: int = 0
    kept: bool | None = None

    def min_version(self) -> int:
        return min(r.version for r in self.reqs)


@dataclass
class _Server:
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    held: Counter = field(default_factory=Counter)  # prompt -> running requests of it
    in_flight: int = 0  # the client's count (least-loaded routing)
    busy_until: float | None = None  # end of the step in progress
    running_n: int = 0  # sequences the step in progress decodes
    paused: bool = False
    version: int = 0
    busy_s: float = 0.0
    seq_s: float = 0.0  # sum of running * step seconds (slot occupancy)


class IdealSchedule:
    """An exact event simulation of the loop's schedule on the cost model, with no overhead:
    requests reach a server, results the client, groups the verifier and the trainer, the
    instant they are sent; scoring takes no time. The same rules as the real parts: the client's
    least-loaded routing of each request (``fleet.group_requests``: a group's G samples to one
    server in one request; ``streamed``, as the built-in engine does, each sample's reply comes as
    it ends, else all with the last one, as SGLang's whole batch reply), the engine's
    first-come slots, a prompt prefilled once per step and not while a sample of it runs, two tokens
    in the admission step, the async loop's room test (``n_async``, the KV cap
    from the length EMA, the bounded queue), staleness drops, the sync loop's waves and surplus,
    the real :class:`PromptSampler`, and the real group filter (``kept``, from the script's
    rewards). ``length(seed)``: completion tokens of the request with that sampling seed."""

    def __init__(
        self,
        mode: str,
        loop,  # LoopConfig
        fleet: SimFleet,
        trainer: SimTrainer,
        sampler,  # PromptSampler
        *,
        prompt: Callable[[object], list[int]],
        length: Callable[[int], int],
        kept: Callable[[list[int]], bool],
        run_seed: int,
        max_new_tokens: int,
        group_requests: bool = False,
        streamed: bool = True,
    ):
        from megatron_rl.orchestration.group_record import request_seed

        self.mode, self.loop, self.fleet, self.trainer, self.sampler = mode, loop, fleet, trainer, sampler
        self.prompt, self.length, self.kept_fn = prompt, length, kept
        self.seed_of = lambda pid, epoch, i: request_seed(run_seed, pid, epoch, i)
        self.max_new_tokens = max_new_tokens
        self.group_requests, self.streamed = group_requests, streamed
        self.servers = [_Server() for _ in range(fleet.servers)]
        self.t, self._events, self._n = 0.0, [], itertools.count()
        self.in_flight, self.ema, self.max_prompt = 0, 0.0, 0
        self.version, self.steps_done, self.index = 0, 0, itertools.count()
        self.completed: deque[_Grp] = deque()  # kept groups, scored (the rollouts' queue)
        self.queue: deque[_Grp] = deque()  # the orchestrator's bounded queue (async)
        self.phase, self.taken, self.stale, self.wave = "take", [], [], []
        self.kept_sync: list[_Grp] = []
        self.train_busy_s = 0.0
        self.step_ends: list[float] = []
        self.counts = {"issued": 0, "dropped": 0, "stale": 0, "engine_steps": 0, "prefill_tokens": 0}

    # -- events
    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._n), fn))

    def run(self, steps: int) -> dict[str, float]:
        """Simulate ``steps`` training steps; wall time, busy fractions and counts."""
        self._react()
        while self.steps_done < steps:
            if not self._events:
                raise RuntimeError(f"ideal schedule: stuck at t={self.t:.3f} s in phase {self.phase}")
            self.t = self._events[0][0]
            while self._events and self._events[0][0] == self.t:
                heapq.heappop(self._events)[2]()
            if self.steps_done < steps:
                self._react()
        wall, f = self.t, self.fleet
        for s in self.servers:  # steps still in progress count up to the end only
            if s.busy_until is not None:
                s.busy_s -= s.busy_until - wall
                s.seq_s -= s.running_n * (s.busy_until - wall)
        return {
            "wall_s": wall,
            "generator_busy": sum(s.busy_s for s in self.servers) / (wall * f.servers),
            "trainer_busy": self.train_busy_s / wall,
            "slot_occupancy": sum(s.seq_s for s in self.servers)
            / max(1e-12, f.slots * sum(s.busy_s for s in self.servers)),
            "step_s": [b - a for a, b in zip([0.0, *self.step_ends], self.step_ends)],
            **{k: float(v) for k, v in self.counts.items()},
        }

    def _react(self) -> None:
        """What the threads do at this instant: issue, hand groups over, train; then the idle
        servers start a step."""
        if self.mode == "async":
            # The assembler fills the queue, the trainer empties it, the assembler fills it
            # again, then the generation thread sees whether there is room.
            self._fill_queue()
            if self.phase == "take":
                self._take_async()
            self._fill_queue()
            g = self.loop.group_size
            while self.in_flight + g <= self._async_cap() and len(self.queue) < self.loop.queue_capacity():
                self._issue()
        elif self.phase == "take":
            self._take_sync()
        for s in self.servers:
            self._start_step(s)

    def _fill_queue(self) -> None:
        while len(self.queue) < self.loop.queue_capacity() and self.completed:
            self.queue.append(self.completed.popleft())

    # -- generation
    def _async_cap(self) -> int:
        cap, f = self.loop.async_cap(), self.fleet
        expected = self.ema or self.loop.expected_length or self.max_new_tokens / 2
        cap = min(cap, int(f.kv_tokens * f.servers // max(1.0, (self.max_prompt or 64) + expected)))
        g = self.loop.group_size
        return max(g, cap - cap % g)

    def _issue(self) -> _Grp:
        problem, epoch = self.sampler.next()
        prompt = tuple(self.prompt(problem))
        self.max_prompt = max(self.max_prompt, len(prompt))
        grp = _Grp(next(self.index), (problem.id, int(epoch)), prompt, [])
        g = self.loop.group_size
        pick = lambda: min(self.servers, key=lambda s: s.in_flight)  # equal capacities: fewest in flight
        server = pick()
        for i in range(g):
            seed = self.seed_of(problem.id, int(epoch), i)
            req = _Req(grp, seed, min(self.length(seed), self.max_new_tokens))
            grp.reqs.append(req)
            if not self.group_requests:  # one request each, each to the least-loaded server
                server = pick()
            server.waiting.append(req)
            server.in_flight += 1
        self.in_flight += self.loop.group_size
        self.counts["issued"] += 1
        return grp

    def _start_step(self, s: _Server) -> None:
        if s.busy_until is not None or s.paused or not (s.waiting or s.running):
            return
        f, finished, prompts = self.fleet, [], set()
        while s.waiting and len(s.running) < f.slots:
            req = s.waiting.popleft()
            if not s.held[req.group.prompt]:  # a running sibling's prompt KV is shared
                prompts.add(req.group.prompt)
            s.held[req.group.prompt] += 1
            req.version, req.written = s.version, 1  # the prefill's token
            (finished if req.written >= req.length else s.running).append(req)
        for req in s.running:
            req.written += 1
        n = len(s.running)
        finished += [r for r in s.running if r.written >= r.length]
        s.running = [r for r in s.running if r.written < r.length]
        for req in finished:
            s.held[req.group.prompt] -= 1
        cost = f.decode_s + f.decode_s_per_seq * n + f.prefill_s_per_token * sum(map(len, prompts))
        s.busy_s += cost
        self.counts["engine_steps"] += 1
        self.counts["prefill_tokens"] += sum(map(len, prompts))
        s.seq_s += n * cost
        s.busy_until, s.running_n = self.t + cost, n
        self._at(s.busy_until, lambda: self._step_done(s, finished))

    def _step_done(self, s: _Server, finished: list[_Req]) -> None:
        s.busy_until = None
        for req in finished:
            if not self.group_requests or self.streamed:  # its reply comes now, else with the group's last
                s.in_flight -= 1
                self.in_flight -= 1
            self.ema = req.length if not self.ema else 0.95 * self.ema + 0.05 * req.length
            grp = req.group
            grp.done += 1
            if grp.done == len(grp.reqs):
                if self.group_requests and not self.streamed:
                    s.in_flight -= len(grp.reqs)
                    self.in_flight -= len(grp.reqs)
                grp.kept = bool(self.kept_fn([r.seed for r in grp.reqs]))
                if grp.kept:
                    self.completed.append(grp)
                else:
                    self.counts["dropped"] += 1

    # -- training
    def _take_async(self) -> None:
        bound = self.loop.staleness_bound()
        while sum(len(x.reqs) for x in self.taken) < self.loop.n_batch and self.queue:
            grp = self.queue.popleft()
            stale = bound is not None and self.version - grp.min_version() > bound
            (self.stale if stale else self.taken).append(grp)
        if sum(len(x.reqs) for x in self.taken) >= self.loop.n_batch:
            for grp in self.stale:
                self.sampler.requeue(grp.key)
            self.counts["stale"] += len(self.stale)
            self._train()

    def _take_sync(self) -> None:
        g, n = self.loop.group_size, self.loop.n_batch
        if any(x.kept is None for x in self.wave):
            return  # the wave is generating
        self.kept_sync += list(self.completed)
        self.completed.clear()
        if len(self.kept_sync) * g < n:
            wave = min(self.loop.async_cap(), n - len(self.kept_sync) * g)
            self.wave = [self._issue() for _ in range(-(-wave // g))]
            return
        self.kept_sync.sort(key=lambda x: x.index)
        for grp in self.kept_sync[n // g :]:
            self.sampler.requeue(grp.key, first=True)
        self.taken, self.kept_sync, self.wave = self.kept_sync[: n // g], [], []
        self._train()

    def _train(self) -> None:
        tokens = sum(len(x.prompt) + r.length for x in self.taken for r in x.reqs)
        seconds = self.trainer.train_s + self.trainer.train_s_per_token * tokens
        self.train_busy_s += seconds
        self.phase = "train"
        self._at(self.t + seconds, self._trained)

    def _trained(self) -> None:
        self.version += 1
        self.phase = "sync"
        if not self.trainer.pause:
            self._at(self.t + self.trainer.sync_s, self._received)
            return
        for s in self.servers:
            s.paused = True  # a step in progress completes first
        start = max([self.t, *(s.busy_until for s in self.servers if s.busy_until is not None)])
        self._at(start + self.trainer.sync_s, self._synced)

    def _received(self) -> None:
        """Every server holds the new weights; each swaps them in when its step ends (tokens of
        that step counted as the new version's: at most one step early), without pausing."""
        for s in self.servers:
            s.version = self.version
        end = max([self.t, *(s.busy_until for s in self.servers if s.busy_until is not None)])
        self._at(end, self._synced)

    def _synced(self) -> None:
        for s in self.servers:
            s.paused, s.version = False, self.version
        self.steps_done += 1
        self.step_ends.append(self.t)
        self.phase, self.taken, self.stale = "take", [], []


def ideal_schedule(
    cfg,  # RunConfig of the mode
    problems: list,
    tokenizer,
    script: list[list[int]],
    lengths: list[int],
    prompts: dict[str, list[int]],
    costs: Costs,
    sizing: dict[str, float],
    args: argparse.Namespace,
) -> dict:
    """The ideal schedule of the loop ``cfg`` on the cost model and fleet: its run's figures.
    Groups are kept by the real reward and filter on the script's completions."""
    import torch

    from megatron_rl.algorithms.filtering import filter_groups
    from megatron_rl.data.problems import reward_input
    from megatron_rl.data.sampling import decode_completion
    from megatron_rl.orchestration.sampler import PromptSampler
    from megatron_rl.rewards.compose import score

    rewards: dict[int, tuple[float, bool, bool]] = {}

    def entry(seed: int) -> tuple[float, bool, bool]:
        i = seed % len(script)
        if i not in rewards:  # the completion as the engine writes it, scored as Rollouts does
            ids = script[i][: lengths[i]]
            inp = reward_input(problems[0], decode_completion(tokenizer, ids), num_tokens=len(ids))
            r = score(inp, cfg.reward)
            rewards[i] = (float(r.reward), bool(r.correct), bool(r.format_ok))
        return rewards[i]

    def kept(seeds: list[int]) -> bool:
        rs = [entry(s) for s in seeds]
        keep, _ = filter_groups(
            torch.tensor([r[0] for r in rs], dtype=torch.float64),
            torch.zeros(len(rs), dtype=torch.long),
            tolerance=cfg.algorithm.filter_tolerance,
            correct=torch.tensor([r[1] for r in rs]),
            format_ok=torch.tensor([r[2] for r in rs]),
        )
        return bool(keep.all())

    speed = sizing["train_speedup"]
    sim = IdealSchedule(
        cfg.loop.mode,
        cfg.loop,
        SimFleet(
            servers=args.servers,
            slots=args.slots,
            kv_tokens=args.slots * args.max_len,
            decode_s=costs.decode_s,
            decode_s_per_seq=costs.decode_s_per_seq,
            prefill_s_per_token=costs.prefill_s_per_token,
        ),
        SimTrainer(
            train_s=costs.train_s / speed,
            train_s_per_token=costs.train_s_per_token / speed,
            sync_s=args.sync_ms / 1e3,
            pause=getattr(args, "pause_mode", "in_place") != "none",
        ),
        PromptSampler(problems, seed=cfg.loop.seed),
        prompt=lambda p: prompts[p.id],
        length=lambda seed: lengths[seed % len(script)],
        kept=kept,
        run_seed=cfg.loop.seed,
        max_new_tokens=cfg.reward.l_max,
        group_requests=cfg.fleet.group_requests is not False,  # auto: the timing servers stream
    )
    return sim.run(args.steps)
