"""Colocated mode on the built-in engine server, over real HTTP with its API key (a server
process of its own, so the weights really cross processes through shared memory): release ->
a generation waits -> resume -> update_weights_from_tensor -> the server holds exactly the sent
weights and generates with them at the new version; bad bodies are refused naming the field and
change nothing; without the key nothing happens."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import pickle
import secrets
import time
import urllib.parse
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from megatron_rl.generation.api import GenRequest, LocalGenerator
from megatron_rl.generation.client import FleetClient, ServerError
from megatron_rl.generation.engine.colocate import TensorPayloadError, load_named_tensors
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.engine.model import Decoder
from megatron_rl.generation.protocol import (
    MEMORY_TAGS,
    memory_payload,
    serialize_named_tensors,
    tensor_digest,
    update_weights_from_tensor_payload,
)
from tests.generation.conftest import prompt

pytestmark = pytest.mark.distributed  # a real server process

KEY = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with EngineProcess(tiny_llama, max_slots=4, max_len=256, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def fleet(server):
    with FleetClient([server.url], api_key=KEY) as f:
        yield f


@pytest.fixture(scope="module")
def weights(tiny_llama) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in Decoder.from_pretrained(tiny_llama).named_weights().items()}


def _post(url: str, route: str, body: object, key: str | None = KEY) -> tuple[int, dict]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", route, body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _state(fleet: FleetClient, url: str) -> tuple[dict[str, str], str, list[str]]:
    """The server's weight digests, its weight version and its released memory."""
    info = fleet.server_info(url)
    return fleet.weights_digest(url), info["weight_version"], info["memory_released"]


def _push(fleet: FleetClient, named: dict[str, torch.Tensor], version: int) -> None:
    fleet.begin_update()
    try:
        fleet.update_weights_from_tensor(serialize_named_tensors(named.items()), weight_version=version)
    finally:
        fleet.end_update()


def _request(rid: str) -> GenRequest:
    return GenRequest(request_id=rid, input_ids=prompt(12, 3), max_new_tokens=10, temperature=1.0, seed=11)


def test_release_holds_generation_then_new_weights_generate(fleet, server, weights, tiny_llama):
    url = server.url
    first = fleet.submit(_request("warm")).result(timeout=60)
    assert first.finish_reason == "length"

    fleet.release_memory()  # every region: kv_cache, weights, cuda_graph
    assert fleet.server_info(url)["memory_released"] == sorted(MEMORY_TAGS)
    # As SGLang's scheduler does, a generation sent now is queued, not refused; it must not run
    # on freed memory: it waits until everything is resumed.
    waiting = fleet.submit(_request("held"))
    time.sleep(1.0)
    assert not waiting.done()
    assert fleet.server_info(url)["internal_states"][0]["num_waiting_reqs"] == 1

    # Weights cannot be written while released (SGLang: resume the weights first).
    fleet.begin_update()
    with pytest.raises(ServerError, match="weights are released"):
        fleet.update_weights_from_tensor(serialize_named_tensors(weights.items()), weight_version=9)
    fleet.end_update()

    # verl's order: weights back, new weights in (while the KV cache is still released), then KV.
    fleet.resume_memory(["weights"])
    assert fleet.server_info(url)["weights_loaded"] is False  # zeros until written
    g = torch.Generator().manual_seed(0)
    new = {n: (t + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in weights.items()}
    _push(fleet, new, version=5)
    digests, version, released = _state(fleet, url)
    assert digests == {n: tensor_digest(t) for n, t in new.items()}  # bit for bit
    assert version == "5" and released == ["cuda_graph", "kv_cache"]
    assert fleet.server_info(url)["weights_loaded"] is True
    time.sleep(0.5)
    assert not waiting.done()  # the KV cache is still released

    fleet.resume_memory(["kv_cache", "cuda_graph"])
    held = waiting.result(timeout=60)
    assert held.finish_reason == "length" and held.versions == [5] * len(held.token_ids)
    # The tokens are the new weights' own: an in-process engine with them draws the same ones.
    local = LocalGenerator.from_pretrained(tiny_llama, max_slots=4, max_len=256)
    local.engine.model.load_state_dict(new)
    (ref,) = local.generate([_request("ref")])
    assert held.token_ids == ref.token_ids
    assert held.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert fleet.server_info(url)["memory_released"] == []


def test_release_is_refused_while_a_request_runs(fleet, server):
    running = fleet.submit(
        GenRequest(request_id="long", input_ids=prompt(8, 1), max_new_tokens=240, temperature=1.0, seed=1)
    )
    deadline = time.monotonic() + 30
    while fleet.server_info(server.url)["internal_states"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline and not running.done()
        time.sleep(0.01)
    fleet.pause("in_place")  # paused in place: still a running request, with its KV cache
    try:
        status, body = _post(server.url, "/release_memory_occupation", {})
        assert status == 400 and "only when server is idle" in body["message"]
        assert fleet.server_info(server.url)["memory_released"] == []
    finally:
        fleet.resume()
    assert running.result(timeout=120).finish_reason == "length"  # nothing was freed under it


@pytest.mark.fault("input")
def test_memory_routes_check_their_tags(server, fleet):
    status, body = _post(server.url, "/release_memory_occupation", {"tags": ["kv_cache", "gpu"]})
    assert status == 400 and body["message"].startswith("tags[1]: 'gpu'")
    status, body = _post(server.url, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "'weights' is not released" in body["message"]
    assert fleet.server_info(server.url)["memory_released"] == []
    fleet.release_memory(["kv_cache"])
    try:
        status, body = _post(server.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 400 and "'kv_cache' is already released" in body["message"]
    finally:
        fleet.resume_memory(["kv_cache"])
    with pytest.raises(ValueError, match="tags"):
        memory_payload(["kv"])


def _storage_pickle(obj: object, reducer_override=None) -> str:
    """``obj`` pickled as the colocated push does, with an optional ``reducer_override``."""
    from megatron_rl.generation.protocol import _reduce_cpu_storage

    class P(ForkingPickler):
        def __init__(self, f):
            super().__init__(f)
            self.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage

    if reducer_override is not None:
        P.reducer_override = reducer_override  # type: ignore[method-assign]
    buf = io.BytesIO()
    P(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))

    marker = ""


def _bad_bodies(weights: dict[str, torch.Tensor], tmp: Path) -> list[tuple[str, dict, str]]:
    """(case, body, what the 400 must say) for hostile or malformed update bodies."""
    name, t = "model.norm.weight", weights["model.norm.weight"]
    nan = t.clone()
    nan[0] = float("nan")
    _Evil.marker = str(tmp / "pwned")
    small = torch.zeros(4)

    def oob(self, obj):  # a tensor of a million floats over a 16-byte storage
        if obj is _OOB:
            from torch.multiprocessing.reductions import rebuild_tensor

            return rebuild_tensor, (torch.Tensor, small.clone()._typed_storage(), (0, (10**6,), (1,), False))
        return NotImplemented

    plain = io.BytesIO()
    ForkingPickler(plain).dump([(name, t.clone())])  # torch's default: a file descriptor
    ok = serialize_named_tensors([(name, t)])

    def body(entry, **over):
        return {**update_weights_from_tensor_payload([entry], weight_version=77), **over}

    return [
        ("unknown name", body(serialize_named_tensors([("model.nope", t)])), "model.nope: not a parameter"),
        ("wrong shape", body(serialize_named_tensors([(name, t[:-1])])), f"{name}: shape"),
        ("int dtype", body(serialize_named_tensors([(name, t.long())])), "not floating point"),
        ("nan", body(serialize_named_tensors([(name, nan)])), "NaN or infinite"),
        ("inf", body(serialize_named_tensors([(name, torch.full_like(t, float("inf")))])), "NaN or infinite"),
        ("not base64", body("%%%"), "serialized_named_tensors[0]: not base64"),
        ("not a pickle", body(base64.b64encode(b"hello").decode()), "not a tensor pickle"),
        ("os.system", body(base64.b64encode(pickle.dumps([_Evil()])).decode()), "posix.system"),
        ("out of bounds", body(_storage_pickle([(name, _OOB)], oob)), "past its storage"),
        ("fd storage", body(base64.b64encode(plain.getvalue()).decode()), "rebuild_storage_fd"),
        ("not a list", body(serialize_named_tensors([])), "non-empty list"),
        ("two ranks", {**body(ok), "serialized_named_tensors": [ok, ok]}, "1 tensor-parallel rank"),
        ("no tensors", {"weight_version": "3"}, "serialized_named_tensors: required"),
        ("load format", body(ok, load_format="flattened_bucket"), "load_format"),
        ("version", body(ok, weight_version="v2"), "weight_version"),
        ("flag", body(ok, abort_all_requests="yes"), "abort_all_requests"),
    ]


_OOB = object()


@pytest.mark.fault("input")
def test_bad_update_bodies_are_refused_and_change_nothing(fleet, server, weights, tmp_path):
    before = _state(fleet, server.url)
    fleet.begin_update()
    try:
        for case, body, says in _bad_bodies(weights, tmp_path):
            status, reply = _post(server.url, "/update_weights_from_tensor", body)
            assert status == 400, (case, status, reply)
            assert says in reply["message"], (case, reply["message"])
            assert _state(fleet, server.url) == before, case
    finally:
        fleet.end_update()
    assert not (tmp_path / "pwned").exists()
    # Outside a session (SGLang 0.5.23: updates sit between begin and end_weight_update).
    status, reply = _post(
        server.url,
        "/update_weights_from_tensor",
        update_weights_from_tensor_payload([serialize_named_tensors(weights.items())], weight_version=8),
    )
    assert status == 400 and "begin_weight_update" in reply["message"]
    assert _state(fleet, server.url) == before
    assert fleet.submit(_request("after")).result(timeout=60).finish_reason == "length"


@pytest.mark.fault("abuse")
def test_no_key_changes_nothing(fleet, server, weights):
    before = _state(fleet, server.url)
    fleet.begin_update()
    try:
        for route, body in (
            ("/release_memory_occupation", {}),
            ("/resume_memory_occupation", {}),
            (
                "/update_weights_from_tensor",
                update_weights_from_tensor_payload(
                    [serialize_named_tensors((n, t + 1) for n, t in weights.items())], weight_version=99
                ),
            ),
        ):
            for key in (None, "wrong"):
                status, reply = _post(server.url, route, body, key=key)
                assert status == 401 and reply == {"error": "Unauthorized"}
    finally:
        fleet.end_update()
    assert _state(fleet, server.url) == before


def test_payload_reader_refuses_without_a_server():
    """The reader on its own: CUDA handles and unknown globals are named, a good payload reads."""
    with pytest.raises(TensorPayloadError, match="posix.system|os.system"):
        load_named_tensors(base64.b64encode(pickle.dumps([_Evil()])).decode())
    t = torch.arange(6.0).reshape(2, 3)
    ((name, back),) = load_named_tensors(serialize_named_tensors([("w", t)]))
    assert name == "w" and torch.equal(back, t) and back.data_ptr() != t.data_ptr()
