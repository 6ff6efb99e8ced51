"""The timing-model engine: scripted tokens picked by seed, the real engine's stopping rules and
versions, the modeled step cost, and the server and fleet client on top of it."""

from __future__ import annotations

import json

import pytest

from megatron_rl.generation.engine.engine import EngineConfig
from megatron_rl.generation.engine.timing import TimingConfig, TimingEngine

EOS = 2
SCRIPT = [[10, 11, 12, EOS], [20, 21, 22, 23, 24, 25, EOS], [30, 31]]


class FakeClock:
    """A clock that moves only when slept on: by the time asked, plus ``overshoot`` (the OS
    waking the sleeper late)."""

    def __init__(self, overshoot: float = 0.0):
        self.now, self.overshoot = 100.0, overshoot
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds + self.overshoot

    def __call__(self) -> float:
        return self.now


def engine(slots: int = 4, clock: FakeClock | None = None, **timing) -> tuple[TimingEngine, list[float]]:
    clock = clock or FakeClock()
    e = TimingEngine(
        TimingConfig(script=SCRIPT, **timing),
        EngineConfig(max_slots=slots, max_len=64),
        eos_token_ids=[EOS],
        vocab_size=100,
        sleep=clock.sleep,
        clock=clock,
    )
    return e, clock.slept


def by_id(finished):
    return {f.request_id: f for f in finished}


def test_seed_picks_the_script_entry_and_stops_like_the_engine():
    e, _ = engine()
    e.add_request("a", [1, 5], max_new_tokens=10, seed=0)
    e.add_request("b", [1, 5], max_new_tokens=10, seed=3002)  # 3002 % 3 == 2
    e.add_request("c", [1, 5], max_new_tokens=4, seed=4)  # entry 1, cut at 4 tokens
    e.add_request("d", [1, 5], max_new_tokens=10, seed=7, stop_token_ids=[22])  # entry 1
    out = by_id(e.generate_all())
    assert out["a"].token_ids == [10, 11, 12, EOS] and out["a"].finish_reason == "stop"
    assert out["b"].token_ids == [30, 31] and out["b"].finish_reason == "stop"  # no EOS: ends
    assert out["c"].token_ids == [20, 21, 22, 23] and out["c"].finish_reason == "length"
    assert out["d"].token_ids == [20, 21, 22] and out["d"].finish_reason == "stop"
    assert all(f.logprobs == [-1.0] * len(f.token_ids) for f in out.values())
    assert all(f.prompt_ids == [1, 5] for f in out.values())


def test_versions_per_token_follow_set_version_and_pause_keeps_requests():
    e, _ = engine()
    e.add_request("r", [1], max_new_tokens=10, seed=1)
    assert e.step() == []  # admission writes 2 tokens, as the real engine's prefill + decode
    e.set_version(3)
    e.pause()
    assert e.step() == [] and e.running == 1 and e.paused
    e.resume()
    e.step()
    e.set_version(4)
    (f,) = e.generate_all()
    assert f.token_ids == SCRIPT[1] and f.versions == [0, 0, 3, 4, 4, 4, 4]


def test_step_sleeps_the_cost_model_and_slots_bound_the_batch():
    e, slept = engine(slots=2, decode_s=0.01, decode_s_per_seq=0.001, prefill_s_per_token=0.0001)
    for i in range(3):
        e.add_request(f"r{i}", [1] * 10 + [i], max_new_tokens=10, seed=1)  # distinct prompts
    e.step()
    assert e.running == 2 and e.waiting == 1 and e.prefill_tokens == 22
    assert slept == [pytest.approx(0.01 + 2 * 0.001 + 22 * 0.0001)]
    e.step()
    assert slept[-1] == pytest.approx(0.012)
    assert e.modeled_s == pytest.approx(sum(slept))
    assert e.capacity_tokens == 2 * 64


def test_a_groups_shared_prompt_is_prefilled_once_as_in_the_real_engine():
    e, slept = engine(slots=8, decode_s=0.0, prefill_s_per_token=0.001)
    for i in range(4):  # one group: four samples of one prompt
        e.add_request(f"g{i}", [1, 2, 3, 4, 5], max_new_tokens=10, seed=1)
    e.add_request("other", [7, 8], max_new_tokens=10, seed=1)
    e.step()
    assert e.running == 5 and e.prefill_tokens == 5 + 2  # not 4 * 5 + 2
    assert slept == [pytest.approx(0.007)]
    # A sample admitted in a later step while its siblings run shares their prompt's KV: no
    # prefill (a group's samples reach free slots one by one in a busy engine).
    e.add_request("late", [1, 2, 3, 4, 5], max_new_tokens=10, seed=1)
    e.step()
    assert e.prefill_tokens == 7 and len(slept) == 1  # a step of no modeled time: no sleep
    # Once no sample of it runs any more, the prompt is prefilled again.
    while e.running:
        e.step()
    e.add_request("again", [1, 2, 3, 4, 5], max_new_tokens=10, seed=1)
    e.step()
    assert e.prefill_tokens == 12 and slept[-1] == pytest.approx(0.005)


def test_sleep_overshoot_is_taken_off_the_next_step_so_time_does_not_drift():
    clock = FakeClock(overshoot=0.002)  # every sleep wakes 2 ms late
    e, slept = engine(slots=4, clock=clock, decode_s=0.01)
    e.add_request("r", [1], max_new_tokens=50, seed=1)
    t0 = clock.now
    for _ in range(5):
        e.step()
    assert slept[0] == pytest.approx(0.01) and slept[1:] == [pytest.approx(0.008)] * 4
    # Five 10 ms steps end 50 ms later plus one overshoot, not plus five.
    assert clock.now - t0 == pytest.approx(0.05 + 0.002)
    assert e.modeled_s == pytest.approx(0.05) and e.late_s == pytest.approx(0.002)
    # A step shorter than what is owed does not sleep; the rest stays owed.
    big = FakeClock(overshoot=0.025)
    e, slept = engine(slots=4, clock=big, decode_s=0.01)
    e.add_request("r", [1], max_new_tokens=50, seed=1)
    e.step()
    e.step()
    assert slept == [pytest.approx(0.01)] and e.late_s == pytest.approx(0.015)


def test_refuses_what_the_engine_refuses_and_aborts():
    e, _ = engine()
    with pytest.raises(ValueError, match="max_len"):
        e.add_request("x", [1] * 60, max_new_tokens=10)
    with pytest.raises(ValueError, match="input_ids"):
        e.add_request("x", [100], max_new_tokens=1)
    e.add_request("x", [1], max_new_tokens=5, seed=1)
    with pytest.raises(ValueError, match="already"):
        e.add_request("x", [1], max_new_tokens=5)
    e.step()
    f = e.abort("x")
    assert f.finish_reason == "abort" and f.token_ids == [20, 21] and not e.has_work()
    with pytest.raises(ValueError, match="script"):
        TimingConfig(script=[])


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"decode_s": -0.1, "script": SCRIPT}, "decode_s: must be >= 0"),
        ({"decode_s_per_seq": "0.1", "script": SCRIPT}, "decode_s_per_seq: must be a finite number"),
        ({"prefill_s_per_token": True, "script": SCRIPT}, "prefill_s_per_token: must be a finite number"),
        ({"decode_s": float("nan"), "script": SCRIPT}, "decode_s: must be a finite number"),
        ({"logprob": 0.5, "script": SCRIPT}, "logprob: a log-probability"),
        ({"script": [[1, 2], []]}, r"script\[1\]: need a non-empty list"),
        ({"script": [[1, 2], [3, 4.5]]}, r"script\[1\]\[1\]: a token id"),
        ({"script": [[1, -2]]}, r"script\[0\]\[1\]: a token id"),
        ({"script": "1 2 3"}, "script: need a non-empty list"),
        ({"decode_ms": 10, "script": SCRIPT}, r"unknown keys \['decode_ms'\]"),
    ],
)
def test_a_bad_calibration_file_is_refused_naming_the_file_and_the_field(tmp_path, obj, field):
    path = tmp_path / "timing.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=field) as err:
        TimingEngine.from_json(path)
    assert str(path) in str(err.value)


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    path = tmp_path / "timing.json"
    path.write_text('{"decode_s": 0.01, "script": [[1, 2]')
    with pytest.raises(ValueError, match="not JSON") as err:
        TimingConfig.from_json(path)
    assert str(path) in str(err.value)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON object is expected"):
        TimingConfig.from_json(path)


def test_served_over_http_with_versions_and_in_place_pause(tmp_path):
    from megatron_rl.generation.api import GenRequest
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.generation.engine.server import EngineServer

    path = tmp_path / "timing.json"
    path.write_text(json.dumps({"decode_s": 0.001, "script": SCRIPT}))
    e = TimingEngine.from_json(path, EngineConfig(max_slots=4, max_len=64), eos_token_ids=[EOS])
    server = EngineServer(e).start()
    fleet = FleetClient([server.url])
    try:
        assert fleet.capacity_tokens() == 4 * 64
        reqs = [GenRequest(request_id=f"r{s}", input_ids=[1, 2], max_new_tokens=16, seed=s) for s in range(6)]
        out = {r.request_id: r for r in fleet.generate(reqs)}
        assert [out[f"r{s}"].token_ids for s in range(6)] == [SCRIPT[s % 3] for s in range(6)]
        assert all(r.versions == [0] * len(r.token_ids) for r in out.values())
        fleet.pause("in_place")
        e.set_version(5)  # what /update_weight_version does, between steps
        fleet.resume()
        (r,) = fleet.generate([GenRequest(request_id="v", input_ids=[1], max_new_tokens=3, seed=1)])
        assert r.token_ids == [20, 21, 22] and r.versions == [5, 5, 5]
        internal = fleet.server_info(server.url)["internal_states"][0]
        assert internal["busy_s"] > 0 and internal["generated_tokens"] == 4 + 7 + 2 + 4 + 7 + 2 + 3
    finally:
        fleet.close()
        server.shutdown()
