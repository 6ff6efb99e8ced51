"""The ideal schedule of ``megatron-rl bench async`` (``tools/async_model.py``): the sync and async
loops' schedules simulated on the cost model with no overhead, checked on small cases worked out
by hand, and the bench's calibration fit and fleet sizing."""

from __future__ import annotations

import argparse

import pytest

from megatron_rl.data.problems import Problem
from megatron_rl.orchestration.config import LoopConfig
from megatron_rl.orchestration.sampler import PromptSampler
from tools.async_model import Costs, IdealSchedule, SimFleet, SimTrainer, _fit, size_fleet

PROBLEMS = [Problem(id=f"p{i}", problem=f"q{i}", task="math", answer="1") for i in range(8)]


def simulate(
    mode,
    *,
    servers=1,
    slots=4,
    g=2,
    n_batch=2,
    n_async=4,
    length=lambda s: 3,
    kept=None,
    decode_s=1.0,
    per_seq=0.0,
    prefill=0.0,
    prompt_len=3,
    steps=2,
    group_requests=False,
    streamed=True,
    pause=True,
):
    loop = LoopConfig(mode=mode, group_size=g, n_batch=n_batch, n_async=n_async)
    sim = IdealSchedule(
        mode,
        loop,
        SimFleet(
            servers=servers,
            slots=slots,
            kv_tokens=10_000,
            decode_s=decode_s,
            decode_s_per_seq=per_seq,
            prefill_s_per_token=prefill,
        ),
        SimTrainer(train_s=0.5, train_s_per_token=0.0, sync_s=0.25, pause=pause),
        PromptSampler(PROBLEMS, seed=0),
        prompt=lambda p: [int(p.id[1:]) + 10] * prompt_len,  # distinct per problem
        length=length,
        kept=kept or (lambda seeds: True),
        run_seed=0,
        max_new_tokens=100,
        group_requests=group_requests,
        streamed=streamed,
    )
    return sim.run(steps)


def test_sync_steps_generate_train_and_update_one_after_the_other():
    # A step: one group of 2 samples of 3 tokens -- the admission step writes 2 tokens (prefill +
    # decode), one more step the third: 2 s; train 0.5 s; the update 0.25 s. Two steps: 5.5 s.
    out = simulate("sync")
    assert out["wall_s"] == pytest.approx(5.5)
    assert out["step_s"] == [pytest.approx(2.75), pytest.approx(2.75)]
    assert out["generator_busy"] == pytest.approx(4 / 5.5)
    assert out["trainer_busy"] == pytest.approx(1.0 / 5.5)
    assert out["issued"] == 2 and out["dropped"] == 0


def test_a_sync_step_waits_for_its_longest_completion():
    # Samples of 2 and 5 tokens: the short one ends in the admission step, the long one 3 steps
    # later; the step lasts 4 s of decoding, the slots are half empty for 3 of them.
    lengths = iter([2, 5])
    out = simulate("sync", length=lambda s: next(lengths), steps=1)
    assert out["wall_s"] == pytest.approx(4 + 0.5 + 0.25)
    assert out["slot_occupancy"] == pytest.approx((2 + 1 + 1 + 1) / (4 * 4))


def test_a_dropped_group_costs_the_sync_step_another_wave():
    verdicts = iter([False, True])
    out = simulate("sync", kept=lambda seeds: next(verdicts), steps=1)
    assert out["wall_s"] == pytest.approx(2 + 2 + 0.5 + 0.25)
    assert out["dropped"] == 1 and out["issued"] == 2


def test_async_generates_while_the_trainer_trains():
    # n_async 4 = two groups at t=0, done at t=2. The queue holds one group (n_batch / G), so the
    # trainer takes g0 (trains 2 .. 2.5, update to 2.75) while g1 waits in the queue and the
    # generators have no room. Step 2 takes g1 at 2.75; the queue has room and g2, g3 start on
    # the server (2.75 .. 3.75) while the trainer trains (to 3.25); the update waits for the
    # server's step in progress (3.75) and holds 0.25 s: the run ends at 4.0, not the sync 5.5.
    out = simulate("async")
    assert out["wall_s"] == pytest.approx(4.0)
    assert out["step_s"] == [pytest.approx(2.75), pytest.approx(1.25)]
    assert out["issued"] == 4 and out["stale"] == 0
    assert out["generator_busy"] == pytest.approx(3 / 4.0)
    assert out["trainer_busy"] == pytest.approx(1.0 / 4.0)


def test_an_update_without_a_pause_ends_when_the_step_in_progress_does():
    # The run above with the built-in engine's streamed update: the transfer (3.25 .. 3.5) overlaps
    # the server's step (2.75 .. 3.75), which goes on; the new weights are swapped in when it ends,
    # and the trainer goes on then: 3.75, not the paused fleet's 4.0.
    out = simulate("async", pause=False)
    assert out["wall_s"] == pytest.approx(3.75)
    assert out["step_s"] == [pytest.approx(2.75), pytest.approx(1.0)]
    assert out["issued"] == 4 and out["stale"] == 0


def test_a_groups_prompt_is_prefilled_once_per_server_and_requests_go_to_the_least_loaded():
    # G=4 over 2 servers: 2 samples each (least-loaded routing alternates). Each server's step
    # costs 1 + 0.1 * 10 (its prompt once, not twice); 2-token samples end in it.
    out = simulate(
        "sync", servers=2, g=4, n_batch=4, n_async=8, length=lambda s: 2, prefill=0.1, prompt_len=10, steps=1
    )
    assert out["wall_s"] == pytest.approx(2.0 + 0.5 + 0.25)
    assert out["generator_busy"] == pytest.approx((2.0 + 2.0) / (2 * 2.75))


def test_a_group_in_one_request_goes_to_one_server_and_holds_its_slots_until_its_last_sample():
    # fleet.group_requests: G=4 all on one server, its prompt prefilled once there: 1 + 0.1 * 10.
    out = simulate(
        "sync",
        servers=2,
        g=4,
        n_batch=4,
        n_async=8,
        length=lambda s: 2,
        prefill=0.1,
        prompt_len=10,
        steps=1,
        group_requests=True,
    )
    assert out["wall_s"] == pytest.approx(2.0 + 0.5 + 0.25)
    assert out["generator_busy"] == pytest.approx(2.0 / (2 * 2.75))  # the other server idles
    assert out["prefill_tokens"] == 10

    # Async, n_async = two groups, each one long sample and three short: a group's whole reply
    # (SGLang's) comes with its long sample, so its short samples' slots stay counted in flight
    # meanwhile; a streamed reply (the built-in engine's) hands each sample back as it ends and
    # refills the slots at once, as one request per sample does.
    def run(group_requests, streamed=True):
        lengths = {}

        def length(seed):
            return lengths.setdefault(seed, 8 if len(lengths) % 4 == 0 else 2)

        return simulate(
            "async",
            g=4,
            slots=8,
            n_batch=4,
            n_async=8,
            length=length,
            steps=3,
            group_requests=group_requests,
            streamed=streamed,
        )

    whole, streamed, per_sample = run(True, streamed=False), run(True), run(False)
    assert whole["wall_s"] > per_sample["wall_s"]
    assert whole["slot_occupancy"] < per_sample["slot_occupancy"]
    assert streamed["wall_s"] == pytest.approx(per_sample["wall_s"])  # one server: the same schedule
    assert streamed["slot_occupancy"] == pytest.approx(per_sample["slot_occupancy"])


def test_decode_cost_grows_with_the_running_batch():
    # Two samples running: each step costs 1 + 2 * 0.5.
    out = simulate("sync", per_seq=0.5, steps=1)
    assert out["wall_s"] == pytest.approx(2 * 2.0 + 0.75)


def test_the_fit_is_least_squares_and_never_negative():
    a, b = _fit([(1, 3.0), (2, 5.0), (3, 7.0)])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(2.0))
    assert _fit([(1, 1.0), (2, 3.0)]) == (0.0, pytest.approx(1.4))  # intercept < 0: through 0
    assert _fit([(1, 3.0), (2, 1.0)]) == (pytest.approx(2.0), 0.0)  # falling: the mean, flat


def test_the_trainer_is_sized_to_the_train_share_of_the_fleets_generation_time():
    costs = Costs(
        decode_s=0.01, decode_s_per_seq=0.0, prefill_s_per_token=0.0, train_s=0.0, train_s_per_token=0.001
    )
    args = argparse.Namespace(
        servers=2, slots=10, n_batch=20, group_size=4, train_share=0.5, train_speedup=None
    )
    sizing = size_fleet(costs, lengths=[10, 30], prompts=[[1] * 5], args=args)
    # 20 sequences of 20 tokens on 20 slots at 10 ms a step: 0.2 s; this trainer: 20 * 25 ms = 0.5 s.
    assert sizing["gen_batch_s"] == pytest.approx(0.2)
    assert sizing["train_batch_s_measured"] == pytest.approx(0.5)
    assert sizing["train_speedup"] == pytest.approx(5.0)  # 0.5 s / (0.5 * 0.2 s)
    assert sizing["train_batch_s"] == pytest.approx(0.1)
    assert sizing["servers_per_trainer"] == pytest.approx(0.4)
