"""The engine server's API key (SGLang's ``--api-key``) over real HTTP: every route but the health
checks wants ``Authorization: Bearer KEY``; a request without it gets 401 and changes nothing
(the weights' digest before equals after, a later generation runs); the client with the key
works end to end, and the key reaches the server through its environment, not its argv."""

from __future__ import annotations

import http.client
import json
import logging
import secrets
import urllib.parse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import FleetClient, ServerError
from megatron_rl.generation.engine.engine import EngineConfig
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.engine.server import GET_ROUTES, OPEN_ROUTES, POST_ROUTES, EngineServer
from megatron_rl.generation.engine.timing import TimingConfig, TimingEngine
from megatron_rl.generation.engine.weights import STREAM_ROUTE, BucketSpec, stream_payload
from megatron_rl.generation.protocol import (
    API_KEY_ENV,
    init_group_payload,
    pack_bucket,
    tensor_digest,
    update_weights_payload,
)
from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig
from tests.generation.conftest import free_port, prompt

KEY = secrets.token_urlsafe(24)

# Every route the server dispatches, read from its tables: a new route cannot escape these tests.
PROTECTED = sorted(
    [("POST", r) for r in POST_ROUTES if r not in OPEN_ROUTES]
    + [("GET", r) for r in GET_ROUTES if r not in OPEN_ROUTES]
)

# Authorization headers that must not open anything: none, a wrong key, the key under another
# scheme or none, the key with a byte more or less.
BAD_AUTH = [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer "]

UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's 401 body (sglang/srt/utils/auth.py)

# The group the refused requests name: the one the client's broadcaster joins with the key later
# (test_the_client_with_the_key_works_end_to_end), which it could not had a refused init joined it.
GROUP = WeightSyncConfig().group_name


@pytest.fixture(scope="module")
def server(tiny_llama):
    with EngineProcess(tiny_llama, max_slots=4, max_len=256, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def hf_weights(tiny_llama) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny_llama) / "model.safetensors"))


def _call(
    url: str, method: str, route: str, body: object = None, authorization: str | None = None
) -> tuple[int, object, dict[str, str]]:
    """(status, JSON body, headers) of one request, with exactly the headers given."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    # A generous timeout, not an unbounded wait: were a refused /init_weights_update_group
    # obeyed, the server would sit in a rendezvous that never comes.
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {} if authorization is None else {"Authorization": authorization}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, route, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    return resp.status, json.loads(raw) if raw else None, dict(resp.getheaders())


def _ok(url: str, method: str, route: str, body: object = None) -> object:
    status, out, _ = _call(url, method, route, body, f"Bearer {KEY}")
    assert status == 200, (route, out)
    return out


def _attacks(hf_weights: dict[str, torch.Tensor], digest_names: list[str]) -> dict[str, object]:
    """Per POST route, a body that would act if the server obeyed it."""
    names, dtypes, shapes, _ = pack_bucket((n, hf_weights[n]) for n in digest_names)
    return {
        "/generate": {"input_ids": prompt(4, 1), "sampling_params": {"max_new_tokens": 4}},
        "/pause_generation": {"mode": "abort"},
        "/abort_request": {"abort_all": True},
        "/init_weights_update_group": init_group_payload(
            master_address="127.0.0.1",
            master_port=free_port(),
            rank_offset=1,
            world_size=2,
            group_name=GROUP,
            backend="gloo",
        ),
        "/destroy_weights_update_group": {"group_name": GROUP},
        "/update_weights_from_distributed": update_weights_payload(
            names=names, dtypes=dtypes, shapes=shapes, group_name=GROUP, weight_version=666
        ),
        "/update_weight_version": {"new_version": "666", "abort_all_requests": True},
        "/megatron_rl/receive_raw": {"group_name": GROUP, "numel": 1 << 20},
        STREAM_ROUTE: stream_payload(
            group_name=GROUP,
            weight_version=666,
            buckets=[BucketSpec(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), 0)],
        ),
    }


@pytest.mark.fault("abuse")
@pytest.mark.distributed
def test_every_route_but_health_answers_401_without_the_key(server, hf_weights):
    assert OPEN_ROUTES == {"/health", "/health_generate"} and OPEN_ROUTES <= set(GET_ROUTES)
    assert {"/generate", "/pause_generation", "/update_weights_from_distributed"} <= set(POST_ROUTES)
    attacks = _attacks(hf_weights, sorted(hf_weights))
    # An unknown path too, as SGLang (its middleware runs before routing): no route probing.
    for method, route in [*PROTECTED, ("GET", "/no_such_route"), ("POST", "/no_such_route")]:
        for auth in BAD_AUTH:
            body = attacks.get(route, {}) if method == "POST" else None
            status, out, headers = _call(server.url, method, route, body, auth)
            assert (status, out) == (401, UNAUTHORIZED), (method, route, auth, status, out)
            assert headers.get("WWW-Authenticate") == "Bearer"
            assert headers.get("Connection") == "close"  # the refused body is never read as a request


@pytest.mark.distributed
def test_health_stays_open_and_the_key_opens_generate(server):
    for route in sorted(OPEN_ROUTES):
        for auth in [None, "Bearer wrong", f"Bearer {KEY}"]:
            status, out, _ = _call(server.url, "GET", route, None, auth)
            assert (status, out) == (200, {}), (route, auth)
    body = {"input_ids": prompt(5, 2), "sampling_params": {"max_new_tokens": 6}}
    for auth in (f"Bearer {KEY}", f"bearer {KEY}"):  # the scheme is case-insensitive (RFC 9110)
        status, out, _ = _call(server.url, "POST", "/generate", body, auth)
        assert status == 200 and isinstance(out, dict) and len(out["output_ids"]) == 6
    # The unknown path is a 404 once the key is right.
    assert _call(server.url, "GET", "/no_such_route", None, f"Bearer {KEY}")[0] == 404


@pytest.mark.fault("abuse")
@pytest.mark.distributed
def test_refused_control_requests_change_nothing(server, hf_weights):
    before = _ok(server.url, "GET", "/megatron_rl/weights_digest")
    assert isinstance(before, dict) and before
    info0 = _ok(server.url, "GET", "/server_info")
    fleet = FleetClient([server.url], api_key=KEY)
    try:
        # A long request in flight while the refused pause / abort / version bump arrive: it
        # must run to its length, untouched.
        long = fleet.submit(GenRequest(request_id="long", input_ids=prompt(6, 3), max_new_tokens=120))
        attacks = _attacks(hf_weights, sorted(before))
        order = [
            "/pause_generation",
            "/abort_request",
            "/init_weights_update_group",
            "/begin_weight_update",
            "/update_weights_from_distributed",
            "/update_weight_version",
            "/end_weight_update",
            "/megatron_rl/receive_raw",
            STREAM_ROUTE,
            "/destroy_weights_update_group",
        ]
        for route in order:
            for auth in (None, "Bearer wrong"):
                status, out, _ = _call(server.url, "POST", route, attacks.get(route, {}), auth)
                assert (status, out) == (401, UNAUTHORIZED), route
        result = long.result(timeout=120)
        assert result.finish_reason == "length" and len(result.token_ids) == 120
        assert set(result.versions) == {int(info0["weight_version"])}
    finally:
        fleet.close()
    after = _ok(server.url, "GET", "/megatron_rl/weights_digest")
    assert after == before
    info = _ok(server.url, "GET", "/server_info")
    assert isinstance(info, dict) and info["weight_version"] == info0["weight_version"]
    state = info["internal_states"][0]
    assert not state["paused"] and state["weight_updates"] == info0["internal_states"][0]["weight_updates"]
    # The server still generates.
    out = _ok(server.url, "POST", "/generate", attacks["/generate"])
    assert isinstance(out, dict) and len(out["output_ids"]) == 4


@pytest.mark.fault("abuse")
@pytest.mark.distributed
def test_the_key_travels_in_the_environment_not_argv(server):
    if not Path(f"/proc/{server.pid}/cmdline").exists():
        pytest.skip("needs /proc")
    argv = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    assert KEY.encode() not in argv
    assert f"{API_KEY_ENV}={KEY}".encode() in environ


@pytest.mark.distributed
def test_the_client_with_the_key_works_end_to_end(server, hf_weights):
    """Last on this server: the update at the end (the control that the routes refused above
    do act with the key) changes its weights."""
    with pytest.raises(ServerError, match="401") as refused:
        FleetClient([server.url], api_key="")
    assert refused.value.status == 401 and "API key" in str(refused.value)
    with pytest.raises(ServerError, match="401"):
        FleetClient([server.url], api_key="wrong")

    fleet = FleetClient([server.url], api_key=KEY)
    try:
        assert fleet.capacity_tokens() == 4 * 256
        (r,) = fleet.generate(
            [GenRequest(request_id="e2e", input_ids=prompt(5, 4), max_new_tokens=8, seed=1)]
        )
        assert len(r.token_ids) == 8 and r.server == server.url
        fleet.pause("in_place")
        assert fleet.server_info(server.url)["internal_states"][0]["paused"]
        fleet.resume()
        assert not fleet.server_info(server.url)["internal_states"][0]["paused"]
        (r,) = fleet.generate(
            [GenRequest(request_id="e2e-2", input_ids=prompt(5, 4), max_new_tokens=8, seed=1)]
        )
        assert len(r.token_ids) == 8

        before = fleet.weights_digest(server.url)
        new = {n: hf_weights[n] + 0.5 for n in sorted(before)}
        bc = WeightBroadcaster(
            lambda: iter(new.items()),
            fleet,
            WeightSyncConfig(backend="gloo", bucket_mb=0.05, verify=True),
        )
        bc.connect()
        try:
            assert bc.sync(version=1)["weight_sync/verified"] == 1.0
        finally:
            bc.close()
        after = fleet.weights_digest(server.url)
        assert after == {n: tensor_digest(t) for n, t in new.items()} and after != before
    finally:
        fleet.close()


@pytest.mark.fault("input")
@pytest.mark.distributed
def test_the_api_key_flag_works_and_a_bad_key_is_refused_at_start(tiny_llama, tmp_path):
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps({"decode_s": 0.0, "script": [[1, 2, 3]]}))
    # A URL-safe key may begin with "-" (1 in 64 of token_urlsafe's): "--api-key=KEY" takes it.
    flag_key = "-" + secrets.token_urlsafe(16)
    args = ["--timing-model", str(timing), f"--api-key={flag_key}"]
    with EngineProcess(tiny_llama, max_slots=2, max_len=64, api_key="", extra_args=args) as s:
        assert _call(s.url, "GET", "/server_info")[0] == 401
        assert _call(s.url, "GET", "/server_info", None, f"Bearer {flag_key}")[0] == 200
    with pytest.raises(RuntimeError, match="exited with 2"):
        EngineProcess(tiny_llama, max_slots=2, max_len=64, extra_args=["--api-key", "two words"]).start()


def test_an_open_server_beyond_loopback_says_so(caplog):
    engine = TimingEngine(TimingConfig(script=[[1, 2]]), EngineConfig(max_slots=1, max_len=16))
    for host, key, warns in [("0.0.0.0", "", True), ("0.0.0.0", KEY, False), ("127.0.0.1", "", False)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_rl.engine_server"):
            srv = EngineServer(engine, host=host, api_key=key)
            srv.shutdown()
        assert any("without an API key" in r.getMessage() for r in caplog.records) == warns, (host, key)
        assert all(KEY not in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="printable ASCII"):
        EngineServer(engine, api_key="caf\u00e9")


def test_the_environment_gives_the_client_and_the_launcher_their_key(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert EngineProcess("unused").api_key == KEY
    assert EngineProcess("unused", api_key="").api_key == ""
    monkeypatch.delenv(API_KEY_ENV)
    assert EngineProcess("unused").api_key == ""
