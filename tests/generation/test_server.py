"""The built-in engine server over real HTTP, the fleet client, and in-flight weight updates
from a real Megatron trainer (gloo update group): the generation issue's acceptance tests."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.generation.api import GenRequest, LocalGenerator
from megatron_rl.generation.client import FleetClient, ServerLost
from megatron_rl.generation.engine import Engine, EngineConfig
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.protocol import FLAT_LOGPROBS, generate_batch_payload, parse_generate_batch
from megatron_rl.types import TrainBatch, TrainSequence
from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig
from tests.generation.conftest import prompt

pytestmark = pytest.mark.distributed  # real processes and process groups


@pytest.fixture(scope="module")
def server(tiny_llama):
    with EngineProcess(tiny_llama, max_slots=8, max_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def trainer(single_rank, tiny_llama):
    from megatron_rl.training.config import OptimConfig, TrainerConfig
    from megatron_rl.training.trainer import PolicyTrainer

    t = PolicyTrainer(tiny_llama, TrainerConfig(optim=OptimConfig(lr=1e-3)), GRPOConfig(), BatchingConfig())
    yield t


@pytest.fixture(scope="module")
def synced(trainer, server, tiny_llama):
    """The server joined to the trainer's update group (rank 0 = this process)."""
    fleet = FleetClient([server.url])
    bc = WeightBroadcaster(trainer.hf_tensors, fleet, WeightSyncConfig(backend="gloo", bucket_mb=0.05))
    bc.connect()
    yield fleet, bc
    bc.close()
    fleet.close()


def _info(url: str) -> dict:
    return json.load(urllib.request.urlopen(f"{url}/server_info"))


def _post(url: str, route: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{url}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _trainer_hf(trainer, tiny_llama) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.hf_tensors()}


def test_generate_over_http_matches_the_in_process_engine(server, tiny_llama):
    fleet = FleetClient([server.url])
    assert fleet.capacity_tokens() == 8 * 512
    reqs = [
        GenRequest(
            request_id=f"r{i}",
            input_ids=prompt(5 + i, i),
            max_new_tokens=10 + i,
            temperature=0.8,
            top_p=0.95,
            seed=100 + i,
        )
        for i in range(6)
    ]
    remote = {r.request_id: r for r in fleet.generate(reqs)}
    local = {
        r.request_id: r
        for r in LocalGenerator.from_pretrained(tiny_llama, max_slots=8, max_len=512).generate(reqs)
    }
    assert sorted(remote) == sorted(local) == [r.request_id for r in reqs]
    for rid, r in remote.items():
        assert r.token_ids == local[rid].token_ids
        torch.testing.assert_close(
            torch.tensor(r.logprobs), torch.tensor(local[rid].logprobs), atol=1e-5, rtol=0
        )
        assert r.versions == [0] * len(r.token_ids) and r.finish_reason == "length"
        assert r.server == server.url
    fleet.close()


def test_flat_logprobs_are_the_triples_log_probs_and_the_client_asks_for_them(server):
    """The built-in engine's compact reply (FLAT_LOGPROBS): one float per output token, the same
    floats as SGLang's triples for the same seeded requests; the fleet client reads either."""
    assert _info(server.url)[FLAT_LOGPROBS] is True
    reqs = [
        GenRequest(request_id=f"f{i}", input_ids=prompt(6, i), max_new_tokens=9, seed=7 + i) for i in range(3)
    ]
    body = generate_batch_payload(reqs)
    status, triples = _post(server.url, "/generate", {**body, "rid": [f"t{i}" for i in range(3)]})
    assert status == 200
    status, flat = _post(server.url, "/generate", generate_batch_payload(reqs, flat_logprobs=True))
    assert status == 200
    for t, f in zip(triples, flat):
        assert f["output_ids"] == t["output_ids"] and "output_token_logprobs" not in f["meta_info"]
        assert f["meta_info"]["output_logprobs"] == [
            lp for lp, _, _ in t["meta_info"]["output_token_logprobs"]
        ]
    read = parse_generate_batch(reqs, flat, server=server.url)
    assert [r.logprobs for r in read] == [f["meta_info"]["output_logprobs"] for f in flat]
    status, err = _post(server.url, "/generate", {**body, FLAT_LOGPROBS: "yes"})
    assert status == 400 and FLAT_LOGPROBS in err["message"]


@pytest.mark.fault("input")
def test_bad_requests_get_a_clear_error(server):
    status, body = _post(server.url, "/generate", {"text": "hello"})
    assert status == 400 and "input_ids" in body["message"]
    status, body = _post(
        server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 600}}
    )
    assert status == 400 and "max_len 512" in body["message"]
    # An image (SGLang's multimodal field): this engine serves language models, text prompts only.
    status, body = _post(
        server.url, "/generate", {"input_ids": [1, 2], "image_data": "data:image/png;base64,iVBO"}
    )
    assert status == 400 and "image_data" in body["message"] and "text prompts only" in body["message"]
    # Routed experts: of an MoE model only; the start within the prompt, as SGLang.
    for bad, field in (
        ({"return_routed_experts": True}, "has no experts"),
        ({"return_routed_experts": "yes"}, "return_routed_experts"),
        ({"return_routed_experts": True, "routed_experts_start_len": 3}, "routed_experts_start_len"),
    ):
        status, body = _post(server.url, "/generate", {"input_ids": [1, 2], **bad})
        assert status == 400 and field in body["message"], (bad, body)
    status, body = _post(server.url, "/pause_generation", {"mode": "retract"})
    assert status == 400 and "in_place" in body["message"]
    status, body = _post(
        server.url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}
    )
    assert status == 400 and "begin_weight_update" in body["message"]
    status, _ = _post(server.url, "/no_such_route", {})
    assert status == 404


def test_update_in_flight_keeps_the_kv_cache_and_versions_the_tokens(synced, trainer, server, tiny_llama):
    fleet, bc = synced
    start_prefill = _info(server.url)["internal_states"][0]["prefill_tokens"]
    ids = prompt(9, 42)
    req = GenRequest(request_id="long", input_ids=ids, max_new_tokens=400, temperature=0.0)
    fut = fleet.submit(req)
    steps0 = _info(server.url)["internal_states"][0]["steps"]
    while _info(server.url)["internal_states"][0]["steps"] < steps0 + 30:
        time.sleep(0.01)
    stats = bc.sync(version=1)
    result = fut.result(timeout=120)
    assert stats["weight_sync/buckets"] > 1  # 50 KB buckets: several broadcasts
    n_old = result.versions.count(0)
    assert 0 < n_old < len(result.token_ids) == 400
    assert result.versions == [0] * n_old + [1] * (400 - n_old)
    # One prefill for the request: its prefix was not recomputed after the update.
    assert _info(server.url)["internal_states"][0]["prefill_tokens"] - start_prefill == len(ids)

    # The same sequence of events in process: old weights for n_old tokens, then the trainer's,
    # keeping the cache. Exact tokens and log-probs: the server continued from its old KV cache.
    new = _trainer_hf(trainer, tiny_llama)
    engine = Engine.from_pretrained(tiny_llama, EngineConfig(max_slots=1, max_len=512))
    engine.add_request("long", ids, max_new_tokens=400, temperature=0.0)
    engine.step()  # prefill + first decode: 2 tokens
    while len(engine._running[0].token_ids) < n_old:
        engine.step()
    with torch.no_grad():
        for n, p in engine.model.named_weights().items():
            p.copy_(new[n])
    engine.set_version(1)
    (ref,) = engine.generate_all()
    assert ref.token_ids == result.token_ids and ref.versions == result.versions
    torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    # ...which a recompute of the prefix under the new weights would not give.
    full = torch.tensor([ids + result.token_ids])
    recomputed = torch.log_softmax(engine.model.full_logits(full)[0, len(ids) - 1 : -1], -1)
    recomputed = recomputed.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert (recomputed[n_old:] - torch.tensor(result.logprobs[n_old:])).abs().max() > 1e-4

    # The server now holds the trainer's weights bit for bit.
    digest = json.load(urllib.request.urlopen(f"{server.url}/megatron_rl/weights_digest"))
    assert digest == {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in new.items()
    }


@pytest.mark.fault("load")
def test_no_request_lost_or_duplicated_across_updates(synced, trainer, server):
    fleet, bc = synced
    reqs = [
        GenRequest(
            request_id=f"q{i}",
            input_ids=prompt(4 + i % 5, 1000 + i),
            max_new_tokens=100 + 35 * i,
            temperature=1.0,
            seed=i,
        )
        for i in range(12)
    ]
    before = int(_info(server.url)["weight_version"])  # 1 after the tests above; 0 run alone
    futs = [fleet.submit(r) for r in reqs]
    for version in (2, 3):
        steps = _info(server.url)["internal_states"][0]["steps"]
        while _info(server.url)["internal_states"][0]["steps"] < steps + 40:
            time.sleep(0.01)
        bc.sync(version=version)
    results = [f.result(timeout=120) for f in futs]
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    assert _info(server.url)["internal_states"][0]["num_running_reqs"] == 0
    for req, r in zip(reqs, results):
        assert len(r.token_ids) == req.max_new_tokens
        assert r.versions == sorted(r.versions) and set(r.versions) <= {before, 2, 3}
    assert any(len(set(r.versions)) > 1 for r in results)


def test_server_logprobs_agree_with_the_trainer(synced, trainer, server):
    fleet, bc = synced
    bc.sync(version=4)
    temperature = 0.7
    reqs = [
        GenRequest(
            request_id=f"lp{i}",
            input_ids=prompt(3 + 2 * i, 500 + i),
            max_new_tokens=24,
            temperature=temperature,
            seed=i,
        )
        for i in range(6)
    ]
    results = sorted(fleet.generate(reqs), key=lambda r: r.request_id)
    batch = TrainBatch(
        sequences=[
            TrainSequence(
                tokens=torch.tensor(r.prompt_ids + r.token_ids),
                prompt_length=len(r.prompt_ids),
                behaviour_logprobs=torch.tensor(r.logprobs),
                versions=torch.tensor(r.versions),
                advantage=0.0,
                weight=1.0,
                group_id=i,
            )
            for i, r in enumerate(results)
        ]
    )
    recomputed = trainer.compute_logprobs(batch, temperature=temperature)
    worst = max(float((torch.tensor(r.logprobs) - lp).abs().max()) for r, lp in zip(results, recomputed))
    assert worst <= 1e-5, worst
    assert all(v == [4] * 24 for v in (r.versions for r in results))


@pytest.mark.fault("crash")
def test_a_killed_server_reports_its_requests_and_they_finish_elsewhere(tiny_llama):
    with (
        EngineProcess(tiny_llama, max_slots=4, max_len=512) as a,
        EngineProcess(tiny_llama, max_slots=4, max_len=512) as b,
    ):
        fleet = FleetClient([a.url, b.url])
        reqs = [
            GenRequest(request_id=f"k{i}", input_ids=prompt(6, 900 + i), max_new_tokens=480, temperature=0.0)
            for i in range(6)
        ]
        futs = {r.request_id: fleet.submit(r) for r in reqs}
        while _info(a.url)["internal_states"][0]["num_running_reqs"] == 0:
            time.sleep(0.01)
        a.kill()
        lost, done = [], []
        for rid, f in futs.items():
            try:
                done.append(f.result(timeout=120))
            except ServerLost as e:
                assert e.url == a.url and e.request_id == rid
                lost.append(rid)
        assert lost and sorted(lost) == sorted(rid for rid, url in fleet.lost)
        assert all(url == a.url for _, url in fleet.lost)
        assert [s.url for s in fleet.alive] == [b.url]
        # Re-send the lost ones: they finish on the surviving server, and greedy decoding on the
        # same weights gives what the lost server would have produced.
        by_id = {r.request_id: r for r in reqs}
        resent = list(fleet.generate(by_id[rid] for rid in lost))
        assert sorted(r.request_id for r in resent) == sorted(lost)
        assert all(r.server == b.url and len(r.token_ids) == 480 for r in resent)
        assert {r.request_id for r in done} | set(lost) == set(by_id)
        fleet.close()
