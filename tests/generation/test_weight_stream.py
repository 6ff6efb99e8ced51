"""The streamed weight update (``generation/engine/weights.py``, ``weight_sync/stream.py``) against
a real built-in engine server over HTTP and real gloo update groups: it gives bit for bit the
weights the per-bucket path gives, without the API key it is refused and changes nothing, and a
malformed manifest, a NaN in a bucket, a trainer that dies mid-update or a server that dies
mid-update change nothing on the server (old weights and version kept, generation goes on, the
next good update is taken) and leave the trainer with an error, not a wait."""

from __future__ import annotations

import http.client
import itertools
import json
import multiprocessing
import os
import secrets
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import ConfigFieldError
from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import FleetClient
from megatron_rl.generation.engine import Engine, EngineConfig
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.engine.weights import STREAM_ROUTE, stream_payload
from megatron_rl.generation.protocol import tensor_digest
from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig
from megatron_rl.weight_sync.stream import bucket_spec
from tests.generation.conftest import free_port, prompt

pytestmark = pytest.mark.distributed  # real processes and process groups

KEY = secrets.token_urlsafe(24)
_names = itertools.count()


@pytest.fixture(scope="module")
def server(tiny_llama):
    with EngineProcess(tiny_llama, max_slots=4, max_len=512, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def fleet(server):
    f = FleetClient([server.url], api_key=KEY)
    yield f
    f.close()


@pytest.fixture(scope="module")
def hf(tiny_llama) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny_llama) / "model.safetensors"))


def _shifted(hf: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors plus seeded noise: weights no server holds yet."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in sorted(hf.items())}


def _connect(fleet: FleetClient, tensors: dict[str, torch.Tensor], **cfg) -> WeightBroadcaster:
    """A broadcaster of ``tensors`` (50 KB buckets: several per update) on a group of its own."""
    cfg.setdefault("bucket_mb", 0.05)
    bc = WeightBroadcaster(
        lambda: iter(tensors.items()),
        fleet,
        WeightSyncConfig(backend="gloo", group_name=f"stream_{next(_names)}", **cfg),
    )
    bc.connect()
    return bc


def _call(url: str, route: str, body: object, auth: str | None = f"Bearer {KEY}") -> tuple[int, dict]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": auth} if auth else {})
    try:
        conn.request(
            "POST" if body is not None else "GET",
            route,
            json.dumps(body) if body is not None else None,
            headers,
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _state(fleet: FleetClient, url: str) -> tuple[dict[str, str], str, int]:
    """What an update may change: the weights' digest, the version, the count of updates."""
    info = fleet.server_info(url)
    return (
        fleet.weights_digest(url),
        str(info["weight_version"]),
        int(info["internal_states"][0]["weight_updates"]),
    )


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in tensors.items()}


def test_the_recipe_field_is_checked():
    assert WeightSyncConfig().stream == "auto" and WeightSyncConfig().pause_mode == "auto"
    with pytest.raises(ConfigFieldError, match="stream"):
        WeightSyncConfig(stream="sometimes")
    with pytest.raises(ConfigFieldError, match="pause_mode"):
        WeightSyncConfig(pause_mode="retract")
    with pytest.raises(ConfigFieldError, match="pause_mode: none needs streamed updates"):
        WeightSyncConfig(pause_mode="none", stream="off")


@pytest.mark.parametrize("pause_mode", ["auto", "in_place"])
def test_the_engine_decodes_while_a_streamed_update_arrives(fleet, server, hf, pause_mode):
    """Unpaused (auto, for a built-in engine), the server steps on through a slow transfer and
    swaps the weights in between two steps; in_place pauses it for the transfer, as SGLang's
    update must. Either way requests in flight keep going: their old tokens, then the new."""
    old, new = _shifted(hf, 10), _shifted(hf, 11)
    slow = threading.Event()

    def tensors():  # a trainer whose gather is slow: ~0.5 s for the whole update
        for n, t in new.items():
            if slow.is_set():
                time.sleep(0.5 / len(new))
            yield n, t

    bc_old = _connect(fleet, old, stream="on")
    cfg = WeightSyncConfig(
        backend="gloo", group_name=f"stream_{next(_names)}", bucket_mb=0.05, pause_mode=pause_mode
    )
    bc = WeightBroadcaster(tensors, fleet, cfg)
    bc.connect()
    samples: list[tuple[bool, int, float]] = []
    results = []
    done = threading.Event()

    def load():  # requests back to back: the engine always has one to decode
        for i in itertools.count():
            if done.is_set():
                return
            req = GenRequest(request_id=f"{pause_mode}-{i}", input_ids=prompt(9, i), max_new_tokens=100)
            results.append(fleet.submit(req).result(timeout=120))

    try:
        bc_old.sync(version=60)
        bc.sync(version=60)  # reads the layout; the timed update follows
        loader = threading.Thread(target=load)
        loader.start()
        while not results:
            time.sleep(0.01)
        slow.set()
        try:
            t0 = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                syncing = pool.submit(bc.sync, version=61)
                while not syncing.done():
                    st = fleet.server_info(server.url)["internal_states"][0]
                    samples.append((st["paused"], st["steps"], st["paused_s"]))
                    time.sleep(0.02)
                syncing.result()
            seconds = time.monotonic() - t0
        finally:
            done.set()
            loader.join()
    finally:
        bc_old.close()
        bc.close()
    assert seconds > 0.4 and len(samples) > 8
    for r in results:
        n_old = r.versions.count(60)
        assert r.versions == [60] * n_old + [61] * (len(r.versions) - n_old)
    paused = sum(p for p, _, _ in samples)
    mid = samples[len(samples) // 4 : -(len(samples) // 4)]  # the transfer, not its ends
    stepped = mid[-1][1] - mid[0][1]
    if pause_mode == "auto":
        assert paused == 0 and samples[-1][2] == samples[0][2]  # never paused
        assert stepped > 0  # it decoded through the transfer
    else:
        assert paused > len(samples) // 2 and samples[-1][2] > samples[0][2] + 0.2
        assert stepped == 0


@pytest.mark.parametrize("cast", [None, "bfloat16"])
def test_a_streamed_update_gives_the_per_bucket_weights_bit_for_bit(fleet, server, hf, cast):
    new, other = _shifted(hf, 1), _shifted(hf, 2)
    per_bucket = _connect(fleet, new, stream="off", cast_dtype=cast)
    streamed_other = _connect(fleet, other, stream="auto", cast_dtype=cast)
    streamed = _connect(fleet, new, stream="on", cast_dtype=cast, verify=cast is None)
    try:
        assert not per_bucket.streaming and streamed.streaming and streamed_other.streaming  # auto: built-in
        s = per_bucket.sync(version=11)
        assert s["weight_sync/streamed"] == 0.0 and s["weight_sync/buckets"] > 1
        by_bucket = fleet.weights_digest(server.url)
        streamed_other.sync(version=12)
        assert fleet.weights_digest(server.url) != by_bucket
        stats = streamed.sync(version=13)
    finally:
        for bc in (per_bucket, streamed_other, streamed):
            bc.close()
    digest, version, _ = _state(fleet, server.url)
    assert digest == by_bucket and version == "13"
    if cast is None:
        assert digest == _digests(new) and stats["weight_sync/verified"] == 1.0
    assert stats["weight_sync/streamed"] == 1.0
    assert stats["weight_sync/buckets"] == s["weight_sync/buckets"] > 1
    assert stats["weight_sync/tensors"] == len(new)
    for part in ("pack_s", "broadcast_s", "apply_s", "control_s"):
        assert stats[f"weight_sync/{part}"] >= 0.0, part


@pytest.mark.fault("abuse")
def test_a_stream_without_the_key_is_refused_and_changes_nothing(fleet, server, hf):
    before = _state(fleet, server.url)
    specs = [bucket_spec([(n, t)]) for n, t in _shifted(hf, 3).items()]
    body = stream_payload(group_name="stream_any", weight_version=666, buckets=specs)
    for auth in (None, "Bearer wrong", f"Bearer {KEY}x"):
        status, out = _call(server.url, STREAM_ROUTE, body, auth)
        assert (status, out) == (401, {"error": "Unauthorized"}), auth
    assert _state(fleet, server.url) == before


def _manifests(good: dict, names: list[str], hf: dict[str, torch.Tensor]) -> dict[str, tuple[dict, str]]:
    """Malformed variants of the manifest ``good``: name -> (body, the field the 400 names)."""

    def edit(fn) -> dict:
        body = json.loads(json.dumps(good))
        fn(body)
        return body

    n0 = good["buckets"][0]["names"][0]
    return {
        "unknown name": (
            edit(lambda b: b["buckets"][0]["names"].__setitem__(0, "model.bogus.weight")),
            "names[0]",
        ),
        "wrong shape": (
            edit(lambda b: b["buckets"][0]["shapes"].__setitem__(0, [d + 1 for d in hf[n0].shape])),
            "shapes[0]",
        ),
        "integer dtype": (edit(lambda b: b["buckets"][0]["dtypes"].__setitem__(0, "int32")), "dtypes[0]"),
        "not a dtype": (edit(lambda b: b["buckets"][0]["dtypes"].__setitem__(0, "manual_seed")), "dtypes[0]"),
        "a name twice": (edit(lambda b: b["buckets"][1]["names"].__setitem__(0, n0)), "twice"),
        "lengths differ": (edit(lambda b: b["buckets"][0]["shapes"].pop()), "buckets[0]"),
        "no version": (edit(lambda b: b.pop("weight_version")), "weight_version"),
        "bad version": (edit(lambda b: b.__setitem__("weight_version", "v2")), "weight_version"),
        "no buckets": (edit(lambda b: b.__setitem__("buckets", [])), "buckets"),
        "a bucket not an object": (edit(lambda b: b["buckets"].__setitem__(0, [1, 2])), "buckets[0]"),
        "unknown group": (edit(lambda b: b.__setitem__("group_name", "no_such_group")), "group_name"),
    }


@pytest.mark.fault("input")
def test_a_malformed_manifest_is_refused_before_any_broadcast(fleet, server, hf):
    new = _shifted(hf, 4)
    bc = _connect(fleet, new, stream="on")
    try:
        before = _state(fleet, server.url)
        specs = [bucket_spec([(n, t)]) for n, t in new.items()]
        good = stream_payload(group_name=bc.cfg.group_name, weight_version=21, buckets=specs)
        for case, (body, field) in _manifests(good, list(new), hf).items():
            status, out = _call(server.url, STREAM_ROUTE, body)
            assert status == 400 and field in out["message"], (case, out)
            assert "nothing will be received" in out["message"] or field == "group_name", case
        # Nothing was opened: no session, no receiver waiting for bytes.
        assert _call(server.url, "/end_weight_update", {})[0] == 400
        assert _state(fleet, server.url) == before
        # The trainer side: an update naming a tensor the server lacks fails at the manifest,
        # before a broadcast could leave it waiting (twice: the update is retried once).
        bogus = _connect(fleet, {**new, "model.bogus.weight": torch.zeros(3)}, stream="on")
        try:
            with pytest.raises(RuntimeError, match="not a parameter"):
                bogus.sync(version=22)
        finally:
            bogus.close()
        assert _state(fleet, server.url) == before
        # ...and the next good update is taken.
        bc.sync(version=23)
        assert _state(fleet, server.url)[:2] == (_digests(new), "23")
    finally:
        bc.close()


@pytest.mark.fault("numeric")
def test_a_nan_in_a_bucket_changes_nothing(fleet, server, hf):
    good = _shifted(hf, 5)
    names = list(good)
    poisoned = dict(good)
    middle = names[len(names) // 2]
    poisoned[middle] = good[middle].clone()
    poisoned[middle].view(-1)[3] = float("nan")
    before = _state(fleet, server.url)
    bad = _connect(fleet, poisoned, stream="on")
    try:
        with pytest.raises(RuntimeError, match=f"{middle}: 1 of .* NaN"):
            bad.sync(version=31)
    finally:
        bad.close()
    assert _state(fleet, server.url) == before
    bc = _connect(fleet, good, stream="on")
    try:
        bc.sync(version=32)
    finally:
        bc.close()
    assert _state(fleet, server.url)[:2] == (_digests(good), "32")


def _die_mid_update(url: str, key: str, port: int, group_name: str, folder: str) -> None:
    """A trainer that announces an update of three buckets, sends one, and dies."""
    from megatron_rl.generation.engine.weights import STREAM_CONTINUE, TRAILER_BYTES, write_trailer
    from megatron_rl.generation.protocol import pack_bucket
    from megatron_rl.generation.update_group import broadcast, init_update_group

    tensors = sorted(load_file(str(Path(folder) / "model.safetensors")).items())
    thirds = [tensors[i::3] for i in range(3)]
    fleet = FleetClient([url], api_key=key)
    futs = fleet.init_update_group_async(
        master_address="127.0.0.1", master_port=port, group_name=group_name, backend="gloo"
    )
    group = init_update_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name=group_name,
    )
    for f in futs:
        f.result()
    specs = [bucket_spec([(n, t + 1.0) for n, t in b]) for b in thirds]
    for f in fleet.update_weights_stream_async(
        stream_payload(group_name=group_name, weight_version=99, buckets=specs)
    ):
        f.result()
    _, _, _, flat = pack_bucket([(n, t + 1.0) for n, t in thirds[0]])
    flat = torch.cat([flat, torch.zeros(TRAILER_BYTES, dtype=torch.uint8)])
    write_trailer(flat, flat.numel() - TRAILER_BYTES, STREAM_CONTINUE)
    broadcast(flat, group, src=0)
    os._exit(3)  # mid-update: no end, no goodbye


@pytest.mark.fault("crash")
def test_a_trainer_dying_mid_update_changes_nothing(fleet, server, hf, tiny_llama):
    before = _state(fleet, server.url)
    long = fleet.submit(GenRequest(request_id="during-death", input_ids=prompt(6, 8), max_new_tokens=300))
    group_name = f"stream_{next(_names)}"
    proc = multiprocessing.get_context("spawn").Process(
        target=_die_mid_update, args=(server.url, KEY, free_port(), group_name, tiny_llama)
    )
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 3
    # The server noticed (its broadcast failed) and applied nothing; it generates on, old weights.
    status, out = _call(server.url, "/end_weight_update", {})
    assert status == 500 and "bucket 1" in out["message"] and "nothing was applied" in out["message"]
    result = long.result(timeout=120)
    assert len(result.token_ids) == 300 and set(result.versions) == {int(before[1])}
    assert _state(fleet, server.url) == before
    # The dead trainer's group is left; a new trainer's update under that name is taken.
    assert _call(server.url, "/destroy_weights_update_group", {"group_name": group_name})[0] == 200
    new = _shifted(hf, 6)
    bc = WeightBroadcaster(
        lambda: iter(new.items()),
        fleet,
        WeightSyncConfig(backend="gloo", group_name=group_name, bucket_mb=0.05, stream="on"),
    )
    bc.connect()
    try:
        bc.sync(version=41)
    finally:
        bc.close()
    assert _state(fleet, server.url)[:2] == (_digests(new), "41")


def test_generation_in_flight_keeps_going_through_a_streamed_update(fleet, server, hf, tiny_llama):
    """As ``test_server.py`` checks for the per-bucket path: one prefill, the old weights' tokens
    then the new ones', exactly what an in-process replay of that sequence of events gives."""
    old, new = _shifted(hf, 7), _shifted(hf, 8)
    bc_old, bc = _connect(fleet, old, stream="on"), _connect(fleet, new, stream="on")
    try:
        bc_old.sync(version=50)
        info = fleet.server_info(server.url)["internal_states"][0]
        ids = prompt(9, 42)
        fut = fleet.submit(GenRequest(request_id="long", input_ids=ids, max_new_tokens=400, temperature=0.0))
        while fleet.server_info(server.url)["internal_states"][0]["steps"] < info["steps"] + 30:
            time.sleep(0.01)
        assert bc.sync(version=51)["weight_sync/streamed"] == 1.0
        result = fut.result(timeout=120)
    finally:
        bc_old.close()
        bc.close()
    n_old = result.versions.count(50)
    assert 0 < n_old < 400 and result.versions == [50] * n_old + [51] * (400 - n_old)
    after = fleet.server_info(server.url)["internal_states"][0]
    assert after["prefill_tokens"] - info["prefill_tokens"] == len(ids)  # its prefix was never recomputed

    engine = Engine.from_pretrained(tiny_llama, EngineConfig(max_slots=1, max_len=512))
    engine.model.load_state_dict(old)
    engine.set_version(50)
    engine.add_request("long", ids, max_new_tokens=400, temperature=0.0)
    engine.step()
    while len(engine._running[0].token_ids) < n_old:
        engine.step()
    engine.model.load_state_dict(new)
    engine.set_version(51)
    (ref,) = engine.generate_all()
    assert ref.token_ids == result.token_ids and ref.versions == result.versions
    torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


@pytest.mark.fault("crash")
def test_a_server_dying_mid_update_gives_the_trainer_an_error(tiny_llama, hf):
    new = _shifted(hf, 9)
    with EngineProcess(tiny_llama, max_slots=2, max_len=64, api_key=KEY) as victim:
        calls = itertools.count()
        fleet = FleetClient([victim.url], api_key=KEY)

        def tensors():
            second = next(calls) == 1  # the first pass reads the layout; the second sends
            for i, item in enumerate(new.items()):
                if second and i == len(new) // 2:
                    victim.kill()
                yield item

        bc = WeightBroadcaster(
            tensors,
            fleet,
            WeightSyncConfig(backend="gloo", bucket_mb=0.05, stream="on"),
        )
        bc.connect()
        try:
            with ThreadPoolExecutor(1) as pool:
                # A guard against a hang, not a timing: the error comes as soon as the peer is gone.
                with pytest.raises(RuntimeError):
                    pool.submit(bc.sync, 61).result(timeout=240)
        finally:
            bc.close()
            fleet.close()


@pytest.mark.fault("input")
def test_tensors_unlike_the_announced_layout_abort_the_stream_and_the_retry_sends_the_right_ones(
    fleet, server, hf
):
    good, other = _shifted(hf, 10), _shifted(hf, 11)
    middle = list(good)[len(good) // 2]
    calls = itertools.count()

    def tensors():
        n = next(calls)  # 0: layout, 1: send (a tensor changed shape), 2: layout again, 3: send
        for name, t in (other if n < 2 else good).items():
            yield name, (t[:-1] if n == 1 and name == middle else t)

    before = _state(fleet, server.url)
    bc = WeightBroadcaster(
        tensors,
        fleet,
        WeightSyncConfig(backend="gloo", bucket_mb=0.05, stream="on"),
    )
    bc.connect()
    try:
        stats = bc.sync(version=71)  # the first try aborts at that bucket; the retry goes through
    finally:
        bc.close()
    assert next(calls) == 4 and stats["weight_sync/streamed"] == 1.0
    digest, version, updates = _state(fleet, server.url)
    assert (digest, version, updates) == (_digests(good), "71", before[2] + 1)  # one update applied
