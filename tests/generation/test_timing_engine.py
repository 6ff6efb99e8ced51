"""The timing-model engine: scripted tokens picked by seed, the real engine's stopping rules and
versions, the modeled step cost, and the server and fleet client on top of it."""

from __future__ import annotations

import json

import pytest

from megatron_rl.generation.engine.engine import EngineConfig
from megatron_rl.generation.engine.timing import TimingConfig, TimingEngine

EOS = 2
SCRIPT = [[10, 11, 12, EOS], [20, 21, 22, 23, 24, 25, EOS], [30, 31]]


def engine(slots: int = 4, **timing) -> tuple[TimingEngine, list[float]]:
    slept: list[float] = []
    e = TimingEngine(
        TimingConfig(script=SCRIPT, **timing),
        EngineConfig(max_slots=slots, max_len=64),
        eos_token_ids=[EOS],
        vocab_size=100,
        sleep=slept.append,
    )
    return e, slept


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
        e.add_request(f"r{i}", [1] * 10, max_new_tokens=10, seed=1)
    e.step()
    assert e.running == 2 and e.waiting == 1 and e.prefill_tokens == 20
    assert slept == [pytest.approx(0.01 + 2 * 0.001 + 20 * 0.0001)]
    e.step()
    assert slept[-1] == pytest.approx(0.012)
    assert e.modeled_s == pytest.approx(sum(slept))
    assert e.capacity_tokens == 2 * 64


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
