"""Evaluation and sampling never wait without end: a score not in by the pool's deadline counts
as ``scoring_timeout``, and a caller's deadline (the run's time limit) cuts generation and
scoring, every sample still counted (``time_limit``, ``not_generated``). Stand-in generators and
pools, so that what is tested is the waiting, in a second or two."""

from __future__ import annotations

import math
import statistics
import threading
import time
from concurrent.futures import Future

import pytest

from megatron_rl.data.problems import Problem
from megatron_rl.data.sampling import SamplingConfig, sample_and_score
from megatron_rl.evaluation.heldout import held_out_pass_at_1
from megatron_rl.generation.api import GenResult
from megatron_rl.rewards.compose import RewardConfig
from megatron_rl.rewards.pool import PoolBroken, PoolTaskError, VerifierPool
from tests.data.tinylm import make_tokenizer

PROBLEMS = [
    Problem(id=f"p{i}", problem=f"What is {i} + 2?", task="math", answer=str(i + 2)) for i in range(3)
]


class Instant:
    """A generator that answers every request at once (``<think>..</think>\\boxed{4}``), or
    only the first ``stall_after`` and then never again (a wedged fleet, until aborted)."""

    def __init__(self, tok, stall_after: int | None = None):
        self.ids = tok("<think>hm</think>\\boxed{4}")["input_ids"]
        self.stall_after = stall_after
        self.aborted = threading.Event()

    def generate(self, requests):
        for n, r in enumerate(requests):
            if self.stall_after is not None and n >= self.stall_after:
                self.aborted.wait(30)
                return
            yield GenResult(
                request_id=r.request_id,
                prompt_ids=r.input_ids,
                token_ids=list(self.ids),
                logprobs=[0.0] * len(self.ids),
                versions=[0] * len(self.ids),
                finish_reason="stop",
            )

    def abort(self):
        self.aborted.set()


class Stuck:
    """A pool whose tasks never finish (a wedged dispatcher), with a deadline ``after_s`` ahead."""

    def __init__(self, after_s: float = 0.3, broken: str | None = None):
        self.after_s, self.broken, self.futures = after_s, broken, []

    def submit(self, fn, *args, timeout_s=None):
        f: Future = Future()
        self.futures.append(f)
        if self.broken:
            f.set_exception(PoolTaskError("worker_crash", self.broken))
        return f

    def deadline(self):
        return time.monotonic() + self.after_s

    def result(self, future, deadline=None, *, reason="scoring_timeout"):
        from megatron_rl.rewards.pool import VerifierPool

        return VerifierPool.result(self, future, deadline, reason=reason)  # the real waiting logic

    def close(self, cancel=False):
        pass


def always_one(completion, problem):
    return 1.0


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_a_score_not_in_by_the_pools_deadline_counts_as_scoring_timeout(tok):
    pool = Stuck(after_s=0.3)
    t0 = time.monotonic()
    got = sample_and_score(
        PROBLEMS, Instant(tok), tok, SamplingConfig(k=2), RewardConfig(), pool=pool, progress=False
    )
    assert time.monotonic() - t0 < 10
    reasons = [a.reason for v in got.values() for a in v]
    assert reasons == ["scoring_timeout"] * 6
    assert all(f.cancelled() for f in pool.futures)  # not started: they will never run


def test_the_callers_deadline_cuts_scoring_and_generation_and_counts_every_sample(tok):
    # Scoring cut: every sample generated, none scored by the deadline.
    rec = held_out_pass_at_1(
        Instant(tok), Stuck(after_s=60), tok, PROBLEMS, SamplingConfig(k=2), RewardConfig(),
        label="after", progress=False, deadline=time.monotonic() + 0.5,
    )  # fmt: skip
    assert rec["partial"] and rec["reasons"] == {"time_limit": 6} and rec["pass@1"] == 0.0
    # Generation cut: two samples come back, then the fleet stalls until it is aborted.
    gen = Instant(tok, stall_after=2)
    t0 = time.monotonic()
    rec = held_out_pass_at_1(
        gen, Stuck(after_s=60), tok, PROBLEMS, SamplingConfig(k=2), RewardConfig(),
        label="after", progress=False, deadline=time.monotonic() + 0.5,
    )  # fmt: skip
    assert time.monotonic() - t0 < 10 and gen.aborted.is_set()
    assert rec["partial"] and rec["samples"] == 2
    assert rec["reasons"] == {"time_limit": 2, "not_generated": 4}


def test_a_pool_that_cannot_start_raises_its_one_line_reason(tok):
    pool = Stuck(broken="3 verifier processes in a row died while starting (exit code 1)")
    with pytest.raises(PoolBroken, match="died while starting"):
        sample_and_score(
            PROBLEMS, Instant(tok), tok, SamplingConfig(k=1), RewardConfig(), pool=pool, progress=False
        )


def test_a_custom_reward_evaluates_problems_without_a_reference(tok):
    # reward.custom replacing the check: held-out problems need no answer (as the training data).
    bare = [Problem(id="q", problem="Name a prime.", task="math", answer=None)]
    cfg = RewardConfig(custom="tests.evaluation.test_deadlines:always_one")
    got = sample_and_score(bare, Instant(tok), tok, SamplingConfig(k=1), cfg, pool=Stuck(0.2), progress=False)
    assert [a.reason for a in got["q"]] == ["scoring_timeout"]


def test_pass_at_1_has_its_standard_error_over_problems_not_samples(tok):
    # The real verifier pool: only p2 ("What is 2 + 2?") is answered right, both of its samples.
    with VerifierPool(1) as pool:
        rec = held_out_pass_at_1(
            Instant(tok),
            pool,
            tok,
            PROBLEMS,
            SamplingConfig(k=2),
            RewardConfig(),
            label="after",
            progress=False,
        )
    assert rec["reasons"] == {"ok": 2, "wrong_answer": 4}
    assert rec["pass@1"] == pytest.approx(1 / 3)
    # Per-problem means 0, 0, 1: stdev 0.577 over sqrt(3) problems (over 6 samples it would be 0.211).
    assert rec["pass@1_se"] == pytest.approx(statistics.stdev([0.0, 0.0, 1.0]) / math.sqrt(3))
