"""Rollouts as a component: its accounting under concurrent producers and consumers, its saved
state and a resume from it, and the staleness of groups whose tokens span a weight update.

Real parts throughout: built-in engine servers (``EngineServer``, in this process) over the
timing model (``generation/engine/timing.py``: a request's sampling seed picks a scripted
completion, so every sample is a known function of its seed), the real ``FleetClient`` over HTTP,
the real ``VerifierPool`` scoring each completion, a tokenizer trained on the workload.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.data.problems import Problem
from megatron_rl.generation.client import FleetClient
from megatron_rl.generation.engine.engine import EngineConfig
from megatron_rl.generation.engine.server import EngineServer
from megatron_rl.generation.engine.timing import TimingConfig, TimingEngine
from megatron_rl.orchestration.config import FleetConfig, LoopConfig
from megatron_rl.orchestration.group_record import GroupRecord, request_seed
from megatron_rl.orchestration.loop import staleness_stats
from megatron_rl.orchestration.recipe import RunConfig
from megatron_rl.orchestration.rollouts import NoProgressError, Rollouts
from megatron_rl.orchestration.sampler import PromptSampler
from megatron_rl.quickstart.tokenizer import (
    QUICKSTART_SYSTEM_PROMPT,
    build_tokenizer,
    load_tokenizer,
    text_ids,
)
from megatron_rl.rewards.compose import RewardConfig
from megatron_rl.rewards.pool import VerifierPool
from megatron_rl.rewards.template import MATH_INSTRUCTION, THINK_CLOSE, THINK_OPEN

G = 4  # samples per group
SEED = 5
L_MAX = 64  # completions stay under l_max - l_cache: rewards are 1.0 (right) or 0.1 (wrong)
MAX_LEN = 512
FILLER = " we add two and two"
DROP_REASONS = {"all_format_failed", "all_correct", "all_wrong", "equal_reward"}


def _problems(n: int = 48) -> list[Problem]:
    return [
        Problem(id=f"p{i:03d}", problem=f"What is 2 + 2? (question {i})", task="math", answer="4")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    corpus = [QUICKSTART_SYSTEM_PROMPT, MATH_INSTRUCTION, *(p.problem for p in _problems())]
    corpus += [f"{THINK_OPEN}{FILLER}{THINK_CLOSE}The answer is \\boxed{{{a}}}." for a in "45"]
    return load_tokenizer(build_tokenizer(corpus, tmp_path_factory.mktemp("rollouts") / "tok"))


@pytest.fixture(scope="module")
def script(tok) -> list[list[int]]:
    """Eight completions: right (4) and wrong (5) answers after 0-3 fillers, each ending in EOS."""
    out = []
    for answer in "45":
        for k in range(4):
            text = f"{THINK_OPEN}{FILLER * k}{THINK_CLOSE}The answer is \\boxed{{{answer}}}."
            out.append(text_ids(tok, text) + [tok.eos_token_id])
    assert max(map(len, out)) < L_MAX - L_MAX // 4
    return out


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(1) as p:
        yield p


class _Clock:
    """The timing engine's sleep: counts engine steps and runs ``at_step[n]()`` after step n (an
    event landing between two steps, as a weight update does)."""

    def __init__(self, at_step: dict | None = None):
        self.steps = 0
        self.at_step = dict(at_step or {})

    def __call__(self, seconds: float) -> None:
        self.steps += 1
        if self.steps in self.at_step:
            self.at_step.pop(self.steps)()
        time.sleep(seconds)


@contextmanager
def timing_fleet(
    tok,
    script,
    *,
    servers: int = 2,
    slots: int = 8,
    at_step: dict | None = None,
    decode_s: float = 0.002,
    request_timeout_s: float = 3600.0,
):
    """``(FleetClient, [TimingEngine])`` over in-process engine servers."""
    engines, started = [], []
    try:
        for _ in range(servers):
            e = TimingEngine(
                TimingConfig(decode_s=decode_s, script=script),
                EngineConfig(max_slots=slots, max_len=MAX_LEN),
                eos_token_ids=[tok.eos_token_id],
                vocab_size=len(tok),
                sleep=_Clock(at_step),
            )
            engines.append(e)
            started.append(EngineServer(e).start())
        fleet = FleetClient([s.url for s in started], request_timeout_s=request_timeout_s)
        try:
            yield fleet, engines
        finally:
            fleet.close()
    finally:
        for s in started:
            s.shutdown()


def make_rollouts(
    fleet,
    pool,
    tok,
    sampler=None,
    version=lambda: 0,
    max_dropped_batches=8,
    language_reward=0.1,
    group_requests=False,
) -> Rollouts:
    cfg = RunConfig(
        loop=LoopConfig(
            group_size=G, n_batch=4 * G, n_async=8 * G, seed=SEED, max_dropped_batches=max_dropped_batches
        ),
        reward=RewardConfig(l_max=L_MAX, l_cache=L_MAX // 4, workers=1, language_reward=language_reward),
        algorithm=GRPOConfig(),
        fleet=FleetConfig(group_requests=group_requests),
    )
    return Rollouts.from_config(
        cfg,
        fleet=fleet,
        pool=pool,
        sampler=sampler or PromptSampler(_problems(), seed=SEED),
        tokenizer=tok,
        system_prompt=QUICKSTART_SYSTEM_PROMPT,
        version=version,
    )


def settle(r: Rollouts, recs: list[GroupRecord], timeout: float = 120.0) -> None:
    """Wait until every group of ``recs`` is scored and filtered."""
    done = r.wait_until(
        lambda: r.failed or (r.in_flight == 0 and all(x.kept is not None for x in recs)), timeout
    )
    r.check()
    assert done, f"{sum(x.kept is None for x in recs)} groups still unfinished after {timeout} s"


def expected_tokens(script, rec: GroupRecord, i: int) -> list[int]:
    """What sample ``i`` of ``rec`` must be: the entry its sampling seed picks."""
    seed = request_seed(SEED, rec.problem.id, rec.epoch, i)
    return script[seed % len(script)][:L_MAX]


@pytest.mark.parametrize("group_requests", [False, "auto"], ids=["per-sample", "per-group-streamed"])
def test_concurrent_producers_and_consumers_account_for_every_group_exactly_once(
    tok, script, pool, group_requests
):
    producers, per_producer, consumers = 4, 8, 3
    with timing_fleet(tok, script) as (fleet, _):
        r = make_rollouts(fleet, pool, tok, group_requests=group_requests)
        assert r.group_requests is (group_requests == "auto")  # auto: the built-in engine streams
        issued: list[GroupRecord] = []
        trained: list[GroupRecord] = []
        requeued: list[GroupRecord] = []
        stop = threading.Event()

        def produce():
            for _ in range(per_producer):
                assert r.wait_until(lambda: r.in_flight + G <= 6 * G, timeout=60)
                issued.append(r.issue_group())

        def consume(k: int):
            while not stop.is_set():
                rec = r.take_completed(timeout=0.01)
                if rec is None:
                    continue
                if (rec.index + k) % 3 == 0:  # set aside (stale, surplus): issued again first
                    requeued.append(rec)
                    r.reissue(rec, first=bool(k % 2))
                else:
                    trained.append(rec)
                    r.retire(rec)

        def checkpoint():  # reads the state while groups are issued, finish and are retired
            n = 0
            while not stop.is_set() or n == 0:
                state = json.loads(json.dumps(r.state_dict()))
                st = Counter(state["stats"])
                reasons = sum(v for k, v in st.items() if k.startswith("reason/"))
                # One instant: nothing is scored before it is generated, nor generated unissued.
                assert reasons <= st["completions"] <= G * st["groups_issued"]
                n += 1
                time.sleep(0.002)
            return n

        with ThreadPoolExecutor(producers + consumers + 1) as ex:
            side = [ex.submit(consume, k) for k in range(consumers)] + [ex.submit(checkpoint)]
            try:
                for f in [ex.submit(produce) for _ in range(producers)]:
                    f.result()
                settle(r, issued)
                kept = sum(bool(x.kept) for x in issued)
                assert r.wait_until(lambda: len(trained) + len(requeued) == kept, timeout=60)
            finally:  # a failure above must not leave the consumers running (the test would hang)
                stop.set()
            assert side.pop().result() > 0  # the checkpoint reader ran
            for f in side:
                f.result()

        dropped = r.drain_dropped()
        state = r.state_dict()
        n = producers * per_producer
        assert len(issued) == n and sorted(x.index for x in issued) == list(range(n))
        # Every group exactly once: trained, set aside, or dropped with its reason.
        ids = lambda recs: [id(x) for x in recs]
        resolved = ids(trained) + ids(requeued) + ids(dropped)
        assert sorted(resolved) == sorted(ids(issued))
        assert all(x.kept for x in trained + requeued) and not any(x.kept for x in dropped)
        assert all(x.drop_reason in DROP_REASONS for x in dropped)
        assert trained and requeued and dropped  # the workload exercises every path
        assert r.pending_keys() == [] and r.in_flight == 0 and r.take_completed(0) is None
        # A prompt is issued once fresh and once more per re-issue taken from the queue.
        left = Counter(tuple(k) for k in state["sampler"]["reissue"])
        times = Counter(x.key for x in issued)
        assert times == Counter(x.key for x in trained + requeued + dropped)
        sent_back = Counter(x.key for x in requeued)
        assert all(times[k] == 1 + sent_back[k] - left[k] for k in times | left)
        # Fresh prompts come in the sampler's own order, whoever draws them.
        fresh: list[tuple[str, int]] = []
        for x in sorted(issued, key=lambda x: x.index):
            if x.key not in fresh:
                fresh.append(x.key)
        reference = PromptSampler(_problems(), seed=SEED)
        assert fresh == [(p.id, e) for p, e in (reference.next() for _ in fresh)]
        # Each sample is the one its seed picks, in its own slot.
        for x in issued:
            assert [s.completion.token_ids for s in x.scored] == [
                expected_tokens(script, x, i) for i in range(G)
            ]
        # The counters agree with the records.
        st = r.snapshot_stats()
        completions = [s for x in issued for s in x.scored]
        assert st["groups_issued"] == n and st["completions"] == G * n
        assert st["generated_tokens"] == sum(len(s.completion.token_ids) for s in completions)
        assert {k: v for k, v in st.items() if k.startswith("reason/")} == {
            f"reason/{k}": v for k, v in Counter(s.reason for s in completions).items()
        }
        assert st["requests_lost"] == st["requests_aborted"] == 0
        assert state["stats"] == dict(st)
        solved = {x.problem.id for x in issued if all(s.correct for s in x.scored)}
        assert state["sampler"]["solved"] == sorted(solved)
        assert 0.0 < r.busy_seconds()


def test_state_saved_mid_flight_resumes_with_the_pending_groups_first_and_the_same_seeds(tok, script, pool):
    with timing_fleet(tok, script) as (fleet, _):
        ref = make_rollouts(fleet, pool, tok)  # the uninterrupted run
        ref_recs = [ref.issue_group() for _ in range(9)]
        settle(ref, ref_recs)
        by_key = {x.key: x for x in ref_recs}

        run = make_rollouts(fleet, pool, tok)  # the run that is interrupted
        first = [run.issue_group() for _ in range(4)]
        settle(run, first)
        kept = run.drain_completed()
        dropped = run.drain_dropped()
        assert len(kept) >= 2 and dropped, "the workload should keep some groups and drop some"
        run.retire(kept[0])  # trained
        fleet.pause("in_place")  # the next groups stay in flight while the state is saved
        try:
            flying = [run.issue_group() for _ in range(2)]
            assert run.in_flight == 2 * G
            state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint writes
        finally:
            fleet.resume()
        settle(run, flying)

        pending = [x.key for x in sorted(kept[1:] + flying, key=lambda x: x.index)]
        assert [tuple(k) for k in state["sampler"]["reissue"]] == pending
        assert set(state["sampler"]) == {
            "epoch",
            "position",
            "reissue",
            "solved",
            "min_difficulty",
            "max_difficulty",
            "drop_solved",
        }
        assert state["stats"]["groups_issued"] == 6 and state["stats"]["completions"] == 4 * G
        assert [x.key for x in first + flying] == [x.key for x in ref_recs[:6]]

        sampler = PromptSampler(_problems(), seed=SEED)
        sampler.load_state_dict(state["sampler"])
        resumed = make_rollouts(fleet, pool, tok, sampler)
        again = [resumed.issue_group() for _ in range(len(pending) + 3)]
        settle(resumed, again)
        # The pending groups first, in issue order; then the cursor goes on where it was.
        assert [x.key for x in again] == pending + [x.key for x in ref_recs[6:9]]
        for x in again:  # the same seeds: the same samples, rewards and filter decisions
            want = by_key[x.key]
            assert [s.completion.token_ids for s in x.scored] == [s.completion.token_ids for s in want.scored]
            assert [s.reward for s in x.scored] == [s.reward for s in want.scored]
            assert (x.kept, x.drop_reason) == (want.kept, want.drop_reason)


def test_groups_spanning_a_weight_update_count_their_staleness_per_token(tok, script, pool):
    version = [0]  # the trainer's policy version
    engines: list[TimingEngine] = []
    update = {3: lambda: engines[0].set_version(1)}  # lands between engine steps 3 and 4
    with timing_fleet(tok, script, servers=1, at_step=update) as (fleet, started):
        engines.extend(started)
        r = make_rollouts(fleet, pool, tok, version=lambda: version[0])
        fleet.pause("in_place")  # all G requests wait, so that step 1 admits them together
        try:
            problem = next(p for p in _problems() if _mixed(script, p))
            rec = r.issue_group(problem, 0)
            url = fleet.servers[0].url
            assert _wait(lambda: fleet.server_info(url)["internal_states"][0]["num_waiting_reqs"] == G)
        finally:
            fleet.resume()
        settle(r, [rec])
        assert rec.kept and rec.issued_version == 0
        versions = [s.completion.versions for s in rec.scored]
        for v in versions:  # each sample's first tokens under version 0, the rest under 1
            assert v[0] == 0 and v[-1] == 1 and v == sorted(v)
        version[0] = 2  # the trainer has moved on twice when the group reaches it
        assert rec.min_version() == 0 and rec.staleness(version[0]) == 2
        tokens = Counter(t for v in versions for t in v)
        total = sum(tokens.values())
        got = staleness_stats([(version[0], list(v)) for v in versions])
        assert got == {
            "staleness/mean": pytest.approx((2 * tokens[0] + tokens[1]) / total),  # float32 mean
            # p95: lag 2 for the version-0 tokens, so 2 unless they are under 5% of all
            "staleness/p95": 2.0 if tokens[0] > 0.05 * total else 1.0,
            "staleness/max": 2.0,
            "staleness/tokens": float(total),
            "staleness/hist/1": tokens[1] / total,
            "staleness/hist/2": tokens[0] / total,
        }

        r.reissue(rec)  # too stale: set aside, its prompt sent again under the new weights
        assert r.pending_keys() == [] and r.state_dict()["sampler"]["reissue"] == [list(rec.key)]
        fresh = r.issue_group()
        settle(r, [fresh])
        assert fresh.key == rec.key and fresh.issued_version == 2
        assert [s.completion.token_ids for s in fresh.scored] == [s.completion.token_ids for s in rec.scored]
        assert all(set(s.completion.versions) == {1} for s in fresh.scored)
        assert fresh.staleness(version[0]) == 1


def _mixed(script, p: Problem) -> bool:
    """Whether ``p``'s group (epoch 0) mixes right and wrong answers (so it is kept) and every
    sample is long enough to see the update land mid-completion."""
    picks = [script[request_seed(SEED, p.id, 0, i) % len(script)] for i in range(G)]
    right = [script.index(e) < len(script) // 2 for e in picks]
    return any(right) and not all(right) and min(map(len, picks)) > 5  # 4 tokens by step 3


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.fault("input")
def test_every_group_dropped_stops_with_a_diagnosis_instead_of_waiting(tok, script, pool):
    """Problems no sample can solve (the answer is 7; the script answers 4 or 5; no language
    bonus, which the tiny tokenizer's text earns unevenly): every group's rewards are equal, so
    no batch can ever fill. After one batch's worth of groups dropped in a
    row (loop.max_dropped_batches: 1, n_batch / G = 4 groups) check() raises with the reasons."""
    unsolvable = [
        Problem(id=f"u{i}", problem=f"What is 3 + 4? ({i})", task="math", answer="7") for i in range(8)
    ]
    with timing_fleet(tok, script) as (fleet, _):
        r = make_rollouts(
            fleet, pool, tok, PromptSampler(unsolvable, seed=SEED), max_dropped_batches=1, language_reward=0.0
        )
        recs = [r.issue_group() for _ in range(3)]
        settle(r, recs)  # three dropped: not yet a stall
        assert [x.kept for x in recs] == [False] * 3
        recs.append(r.issue_group())
        with pytest.raises(NoProgressError) as e:
            settle(r, recs)
        msg = str(e.value)
        assert "last 4 groups were all dropped" in msg and "all_wrong: 4" in msg
        assert "wrong_answer" in msg  # the verifier's reason for the samples


@pytest.mark.fault("crash")
@pytest.mark.parametrize("group_requests", [False, "auto"], ids=["per-sample", "per-group-streamed"])
def test_a_request_past_its_timeout_is_sent_once_more_then_scored_as_it_stands(
    tok, script, pool, group_requests
):
    """Decoding at 0.2 s a token, no sample finishes within the fleet's 0.3 s timeout: each is
    aborted on its server, re-sent once (to the other server), aborted again, then scored with
    no tokens (no reward): the group ends, nothing hangs and nothing is lost."""
    with timing_fleet(tok, script, decode_s=0.2, request_timeout_s=0.3) as (fleet, _):
        r = make_rollouts(fleet, pool, tok, group_requests=group_requests)
        recs = [r.issue_group() for _ in range(2)]
        settle(r, recs)
        st = r.snapshot_stats()
        assert st["requests_timed_out"] == 2 * 2 * G and st["completions"] == 2 * G
        for rec in recs:
            assert rec.timed_out == [2] * G and not rec.kept  # every sample: no tokens, same reward
            assert all(s.completion.token_ids == [] for s in rec.all_scored())
        servers = Counter(url for _, url in fleet.timed_out)
        assert sorted(servers.values()) == [2 * G, 2 * G]  # the second try went to the other one
        state = [fleet.server_info(u)["internal_states"][0] for u in fleet.update_urls]
        assert all(x["num_running_reqs"] + x["num_waiting_reqs"] == 0 for x in state), state


class _StuckPool:
    """A verifier pool that takes tasks and never answers (a wedged pool), or is broken."""

    def __init__(self, broken: str | None = None):
        from concurrent.futures import Future

        self.futures: list[Future] = []
        self.broken = broken
        self._future = Future

    def submit(self, fn, *args, timeout_s=None):
        if self.broken:
            from megatron_rl.rewards.pool import PoolBroken

            raise PoolBroken(self.broken)
        f = self._future()
        self.futures.append(f)
        return f

    def submit_many(self, fn, items, *, timeout_s=None):
        return [self.submit(fn, *item) for item in items]

    def deadline(self) -> float:
        return time.monotonic() + 0.5


@pytest.mark.fault("crash")
def test_a_sample_not_scored_by_its_deadline_scores_0_and_its_group_finishes(tok, script):
    stuck = _StuckPool()
    with timing_fleet(tok, script) as (fleet, _):
        r = make_rollouts(fleet, stuck, tok)
        recs = [r.issue_group() for _ in range(2)]
        assert r.outstanding == 2 * G  # generating or scoring: what the async loop bounds
        assert r.wait_until(lambda: r.in_flight == 0, timeout=60)
        assert r.outstanding == 2 * G  # generated, not scored: still counted
        t0 = time.monotonic()
        while any(x.kept is None for x in recs):  # the loop's waits call check() like this
            r.check()
            time.sleep(0.05)
            assert time.monotonic() - t0 < 30
        assert r.outstanding == 0
        assert {s.reason for x in recs for s in x.all_scored()} == {"scoring_timeout"}
        assert r.snapshot_stats()["reason/scoring_timeout"] == 2 * G
        assert all(f.cancelled() for f in stuck.futures)  # they will never run


@pytest.mark.fault("crash")
def test_a_pool_that_cannot_start_stops_the_rollouts_with_its_reason(tok, script):
    from megatron_rl.rewards.pool import PoolBroken

    with timing_fleet(tok, script) as (fleet, _):
        r = make_rollouts(fleet, _StuckPool(broken="3 verifier processes in a row died while starting"), tok)
        r.issue_group()
        assert r.wait_until(lambda: r.failed, timeout=60)
        with pytest.raises(PoolBroken, match="died while starting"):
            r.check()


def test_staleness_counts_from_the_weights_that_train_each_minibatch():
    """With several minibatches a step, the second is trained by version + 1: a token generated
    by the step's starting weights is one version behind there (the Figure 6b setting)."""
    got = staleness_stats([(5, [5, 5, 4]), (6, [5, 5]), (6, [6])])
    # lags: 0 0 1 | 1 1 | 0
    assert got["staleness/mean"] == pytest.approx(3 / 6)
    assert got["staleness/tokens"] == 6.0 and got["staleness/max"] == 1.0
    assert got["staleness/p95"] == 1.0
    assert got["staleness/hist/0"] == pytest.approx(0.5) and got["staleness/hist/1"] == pytest.approx(0.5)
    assert staleness_stats([]) == {}
    many = staleness_stats([(100, [100] * 96 + [90] * 4)])  # 4% of tokens 10 behind: p95 is 0
    assert many["staleness/p95"] == 0.0 and many["staleness/max"] == 10.0
