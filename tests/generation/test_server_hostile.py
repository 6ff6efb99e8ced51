"""The engine server against hostile clients and bad arguments, over real HTTP on 127.0.0.1:
stalled and dribbling clients cut at the read deadline while others are served, a client
address over its connection limit refused, every control route answering a bad value at once
with a 400 naming the field (versions out of range included), a master that does not answer
refused by address within the connect timeout, every /generate field it does not implement
refused by name (lora_path above all) and every integer that would reach torch range-checked,
each leaving the weights and the version as they were, a tensor in another dtype cast and said
so, and every bad ``serve-engine`` argument one line naming the flag, before the model loads."""

from __future__ import annotations

import ast
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.engine.requests import (
    _GENERATE_INERT,
    _GENERATE_KEYS,
    _GENERATE_OFF,
    ROUTER_FIELDS,
)
from megatron_rl.generation.protocol import (
    FLAT_LOGPROBS,
    SGLANG_VERSION,
    serialize_named_tensors,
    tensor_digest,
    update_weights_from_tensor_payload,
)
from megatron_rl.generation.update_group import init_update_group, probe_master
from tests.generation.conftest import TINY, free_port, prompt
from tests.generation.test_server_hygiene import _Group

pytestmark = pytest.mark.distributed  # real server processes (and a real gloo group below)

REPO = Path(__file__).resolve().parents[2]
READ_TIMEOUT_S = 1.5  # short, so that the deadline tests are quick; the default is 30 s
MARGIN_S = 60.0  # the generous upper bound a poll waits (no speed is asserted)
STALLED = 300


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[EngineProcess]:
    args = ["--read-timeout-s", str(READ_TIMEOUT_S)]
    with EngineProcess(tiny_llama, max_slots=4, max_len=128, extra_args=args) as s:
        yield s


def _addr(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _call(url: str, method: str, route: str, body: object = None, timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON body) of one request on a connection of its own."""
    conn = http.client.HTTPConnection(*_addr(url), timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, route, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    assert b"Traceback" not in raw, raw
    return resp.status, json.loads(raw)


def _generate(url: str, n: int = 4) -> tuple[int, dict]:
    return _call(
        url, "POST", "/generate", {"input_ids": prompt(5, 1), "sampling_params": {"max_new_tokens": n}}
    )


def _read_until_closed(socks: list[socket.socket], timeout_s: float) -> dict[socket.socket, bytes]:
    """What each socket received up to the server's close (EOF or reset); the sockets still
    open after ``timeout_s`` are missing from the answer."""
    got: dict[socket.socket, bytearray] = {s: bytearray() for s in socks}
    closed: set[socket.socket] = set()
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    deadline = time.monotonic() + timeout_s
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for fd, _ in poller.poll(200):
            s = by_fd[fd]
            try:
                chunk = s.recv(1 << 16)
            except ConnectionError:
                chunk = b""
            if chunk:
                got[s] += chunk
            else:
                closed.add(s)
                poller.unregister(fd)
    return {s: bytes(got[s]) for s in closed}


# ---------------------------------------------------------------------- slow clients


@pytest.mark.fault("abuse")
def test_stalled_partial_bodies_are_closed_at_the_read_deadline_while_others_are_served(server):
    """300 connections send their head and part of a body, then stall: each is answered 408
    and closed by the server (no request is left holding a thread), and a normal client's
    /generate is served the while."""
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    socks = []
    try:
        for _ in range(STALLED):
            s = socket.create_connection(_addr(server.url), timeout=60)
            s.sendall(head + b'{"input_id')  # 10 of the 1000 bytes announced
            socks.append(s)
        status, out = _generate(server.url)
        assert status == 200 and len(out["output_ids"]) == 4, out
        answers = _read_until_closed(socks, READ_TIMEOUT_S + MARGIN_S)
        assert len(answers) == STALLED, f"{STALLED - len(answers)} stalled connections still open"
        for raw in answers.values():
            assert raw.startswith(b"HTTP/1.1 408 "), raw[:200]
            assert b"--read-timeout-s" in raw, raw
    finally:
        for s in socks:
            s.close()
    assert _generate(server.url)[0] == 200


@pytest.mark.fault("abuse")
def test_a_client_dribbling_its_headers_is_cut_at_the_deadline(server):
    """A byte every 0.1 s keeps every read short of a per-read timeout; the deadline covers the
    whole request, so the server still closes it (after about READ_TIMEOUT_S, well before the
    200-byte header would be done)."""
    header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(_addr(server.url), timeout=60) as s:
        closed = False
        deadline = time.monotonic() + READ_TIMEOUT_S + MARGIN_S
        for byte in header:
            try:
                s.sendall(bytes([byte]))
            except OSError:  # a reset: the server closed it
                closed = True
                break
            if select.select([s], [], [], 0.1)[0]:
                closed = True  # EOF (or a reset) is readable: the server is done with it
                break
            assert time.monotonic() < deadline
        assert closed, "the server read a dribbled header to its end"
    # An idle connection (nothing sent) is closed by the same deadline.
    with socket.create_connection(_addr(server.url), timeout=60) as idle:
        assert _read_until_closed([idle], READ_TIMEOUT_S + MARGIN_S) == {idle: b""}


@pytest.mark.fault("abuse")
def test_a_generation_may_wait_longer_than_the_read_deadline(server):
    """The deadline is for reading the request: a request that arrived whole waits for its
    tokens as long as it takes (here: paused past the deadline, then resumed)."""
    assert _call(server.url, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    s = socket.create_connection(_addr(server.url), timeout=60)
    try:
        body = json.dumps({"input_ids": prompt(5, 2), "sampling_params": {"max_new_tokens": 3}}).encode()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(READ_TIMEOUT_S + 1.0)
    finally:
        assert _call(server.url, "POST", "/continue_generation", {})[0] == 200
    with s:
        resp = http.client.HTTPResponse(s)
        resp.begin()
        out = json.loads(resp.read())
    assert resp.status == 200 and len(out["output_ids"]) == 3, out


@pytest.mark.fault("abuse")
def test_a_client_over_its_connection_limit_is_answered_503(tiny_llama):
    cap = 8
    args = ["--max-conns-per-client", str(cap)]
    with EngineProcess(tiny_llama, max_slots=2, max_len=64, extra_args=args) as capped:
        held = [socket.create_connection(_addr(capped.url), timeout=60) for _ in range(cap)]
        try:
            for s in held:  # each holds its connection: a request whose body never comes
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            # The server accepts connections in the order they came: these 8 before the next.
            status, out = _call(capped.url, "GET", "/health")
            assert status == 503 and "--max-conns-per-client" in out["message"], out
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + MARGIN_S
        while _call(capped.url, "GET", "/health")[0] != 200:  # their threads end; served again
            assert time.monotonic() < deadline, "the closed connections still count"
            time.sleep(0.1)
        assert _generate(capped.url)[0] == 200


# ---------------------------------------------------------------------- control routes

BAD_CONTROL: list[tuple[str, dict, str]] = [
    ("/init_weights_update_group", {"backend": "mpi"}, "backend"),
    ("/init_weights_update_group", {"backend": "nccl"}, "backend"),  # no CUDA here
    ("/init_weights_update_group", {"backend": ["gloo"]}, "backend"),
    ("/init_weights_update_group", {"master_port": 70000}, "master_port"),
    ("/init_weights_update_group", {"master_port": 0}, "master_port"),
    ("/init_weights_update_group", {"master_port": "x"}, "master_port"),
    ("/init_weights_update_group", {"master_port": True}, "master_port"),
    ("/init_weights_update_group", {"master_port": 1.5}, "master_port"),
    ("/init_weights_update_group", {"master_address": ""}, "master_address"),
    ("/init_weights_update_group", {"master_address": ["127.0.0.1"]}, "master_address"),
    ("/init_weights_update_group", {"master_address": "a host"}, "master_address"),
    ("/init_weights_update_group", {"world_size": 1}, "world_size"),
    ("/init_weights_update_group", {"world_size": -3}, "world_size"),
    ("/init_weights_update_group", {"world_size": 2**70}, "world_size"),
    ("/init_weights_update_group", {"master_port": -1}, "master_port"),
    ("/init_weights_update_group", {"rank_offset": 1.5}, "rank_offset"),
    ("/init_weights_update_group", {"rank_offset": 0}, "rank_offset"),
    ("/init_weights_update_group", {"rank_offset": 2}, "rank_offset"),  # world_size 2
    ("/init_weights_update_group", {"rank_offset": None}, "rank_offset"),
    ("/init_weights_update_group", {"group_name": ["g"]}, "group_name"),
    ("/init_weights_update_group", {"group_name": ""}, "group_name"),
    ("/destroy_weights_update_group", {"group_name": {"a": 1}}, "group_name"),
    ("/destroy_weights_update_group", {"group_name": "no_such_group"}, "group_name"),
    ("/update_weights_from_distributed", {"group_name": [1]}, "group_name"),
    ("/update_weights_from_distributed", {"abort_all_requests": "yes"}, "abort_all_requests"),
    ("/update_weights_from_distributed", {"flush_cache": 1}, "flush_cache"),
    ("/update_weights_from_distributed", {"selector": "draft"}, "selector"),
    ("/update_weights_from_distributed", {"shapes": [[10**12]]}, "shapes[0]"),
    ("/update_weights_from_distributed", {"dtypes": ["float99"]}, "dtypes[0]"),
    ("/update_weights_from_distributed", {"weight_version": [1]}, "weight_version"),
    ("/update_weight_version", {"new_version": "1", "abort_all_requests": "no"}, "abort_all_requests"),
    ("/update_weight_version", {"new_version": {"v": 1}}, "new_version"),
    # Versions feed the staleness metrics: integers in [0, 2**63 - 1] (or their digits) only.
    ("/update_weight_version", {"new_version": -5}, "new_version"),
    ("/update_weight_version", {"new_version": 1.5}, "new_version"),
    ("/update_weight_version", {"new_version": True}, "new_version"),
    ("/update_weight_version", {"new_version": 2**70}, "new_version"),
    ("/update_weight_version", {"new_version": 2**63}, "new_version"),
    ("/update_weight_version", {"new_version": "-5"}, "new_version"),
    ("/update_weight_version", {"new_version": "1.5"}, "new_version"),
    ("/update_weight_version", {"new_version": "+5"}, "new_version"),
    ("/update_weight_version", {"new_version": ""}, "new_version"),
    ("/update_weights_from_distributed", {"weight_version": -1}, "weight_version"),
    ("/update_weights_from_distributed", {"weight_version": str(2**64)}, "weight_version"),
    ("/megatron_rl/receive_raw", {"numel": -1}, "numel"),
    ("/megatron_rl/receive_raw", {"numel": "lots"}, "numel"),
    ("/megatron_rl/receive_raw", {"numel": 10**15}, "numel"),
    ("/megatron_rl/receive_raw", {"numel": True}, "numel"),
    ("/megatron_rl/receive_raw", {"numel": 8, "group_name": 3}, "group_name"),
    ("/megatron_rl/receive_raw", {"numel": 2.5}, "numel"),
    ("/megatron_rl/update_weights_stream", {"buckets": [], "weight_version": 1}, "buckets"),
    ("/megatron_rl/update_weights_stream", {"buckets": [{}]}, "weight_version"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/pause_generation", {"mode": ["abort"]}, "mode"),
    ("/continue_generation", {"torch_empty_cache": "yes"}, "torch_empty_cache"),
    ("/flush_cache", {"timeout_s": "soon"}, "timeout_s"),
    ("/flush_cache", {"timeout_s": -1}, "timeout_s"),
    ("/abort_request", {"rid": {"a": 1}}, "rid"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/weights_checker", {"action": "compare"}, "action"),
    ("/update_weights_from_tensor", {}, "serialized_named_tensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": "npz"}, "load_format"),
    (
        "/update_weights_from_tensor",
        {"serialized_named_tensors": ["x"], "weight_version": 1.5},
        "weight_version",
    ),
    ("/release_memory_occupation", {"tags": "weights"}, "tags"),
    ("/resume_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
]
_GROUP = {
    "master_address": "127.0.0.1",
    "master_port": 29999,
    "rank_offset": 1,
    "world_size": 2,
    "group_name": "hostile",
    "backend": "gloo",
}
_UPDATE = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "hostile"}
_BASE = {"/init_weights_update_group": _GROUP, "/update_weights_from_distributed": _UPDATE}


@pytest.mark.fault("input")
def test_every_control_route_answers_a_bad_value_with_a_400_naming_it(server):
    """Each body is a valid one with one bad field: the answer is a 400 naming that field, sent
    before anything is waited for (a rendezvous, a broadcast): the client's timeout here is far
    below the update group's 120 s."""
    assert _call(server.url, "POST", "/begin_weight_update", {})[0] == 200
    try:
        for route, bad, field in BAD_CONTROL:
            body = {**_BASE.get(route, {}), **bad}
            status, out = _call(server.url, "POST", route, body, timeout=30)
            assert status == 400 and field in out["message"], (route, bad, status, out)
    finally:
        assert _call(server.url, "POST", "/end_weight_update", {})[0] == 200
    info = _call(server.url, "GET", "/server_info")[1]
    state = info["internal_states"][0]
    assert not state["paused"] and state["weight_updates"] == 0
    assert info["weight_version"] == "0", info  # no refused version was set
    assert _generate(server.url)[0] == 200


@pytest.mark.fault("input")
def test_a_streamed_update_with_a_version_out_of_range_is_refused_before_any_receive(server, hf_weights):
    """A manifest valid but for its version: refused naming weight_version, nothing received
    (the group it names does not even exist: the version is checked first)."""
    name = sorted(hf_weights)[0]
    t = hf_weights[name]
    bucket = {"names": [name], "dtypes": [str(t.dtype).removeprefix("torch.")], "shapes": [list(t.shape)]}
    for version in (-1, 2**63, "1.5"):
        body = {"group_name": "no_such_group", "weight_version": version, "buckets": [bucket]}
        status, out = _call(server.url, "POST", "/megatron_rl/update_weights_stream", body, timeout=30)
        assert status == 400 and "weight_version" in out["message"], (version, out)
    assert _call(server.url, "POST", "/end_weight_update", {})[0] == 400  # no session was opened
    assert _call(server.url, "GET", "/server_info")[1]["weight_version"] == "0"


# ---------------------------------------------------------------------- a master that does not answer


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released: a connect to it is refused)."""
    return free_port()


@pytest.mark.fault("input")
def test_joining_a_master_that_does_not_answer_fails_within_the_connect_timeout_naming_it():
    """The joining side as a function: the connect timeout is a parameter, and the error names
    the address and port that did not answer (not torch's connect retries for the whole 120 s
    group timeout, which took 205 s)."""
    port = _closed_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*within 0.5 s"):
        init_update_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank=1,
            world_size=2,
            group_name="nobody_home",
            connect_timeout_s=0.5,
        )
    with pytest.raises(ConnectionError, match=r"\[::1\]:"):  # an IPv6 address in brackets
        probe_master("::1", port, 0.2)
    with socket.socket() as s:  # a listening master is found at once
        s.bind(("127.0.0.1", 0))
        s.listen()
        probe_master("127.0.0.1", s.getsockname()[1], 5.0)


@pytest.mark.fault("input")
def test_init_group_with_a_master_that_does_not_answer_is_a_400_naming_it(server):
    """Over HTTP: refused within the server's connect timeout (10 s by default; the bound here is
    only the generous one that tells it from the old 205 s), naming master_address:master_port;
    the server then joins a group, of the same name, whose master does answer."""
    port = _closed_port()
    body = {**_GROUP, "master_port": port, "group_name": "hostile_closed"}
    t0 = time.monotonic()
    status, out = _call(server.url, "POST", "/init_weights_update_group", body, timeout=MARGIN_S)
    assert time.monotonic() - t0 < MARGIN_S
    assert status == 400 and f"127.0.0.1:{port}" in out["message"], out
    assert "master_address" in out["message"], out
    group = _Group(server.url, "hostile_closed")  # nothing of the failed join was left behind
    group.close()
    assert _generate(server.url)[0] == 200


# ---------------------------------------------------------------------- /generate fields

_ADAPTER = "/adapters/math-lora"
BAD_GENERATE: list[tuple[dict, str]] = [
    ({"lora_path": _ADAPTER}, "lora_path: no LoRA adapter is loaded on this server"),
    ({"lora_path": [_ADAPTER]}, "lora_path: no LoRA adapter is loaded on this server"),
    ({"lora_id": "math"}, "lora_id: no LoRA adapter is loaded"),
    ({"return_hidden_states": True}, "return_hidden_states:"),  # unimplemented, set
    ({"logprob_start_len": 0}, "logprob_start_len:"),  # prompt log-probs
    ({"top_logprobs_num": 5}, "top_logprobs_num:"),
    ({"custom_logit_processor": "x"}, "custom_logit_processor:"),
    ({"input_embeds": [[0.0]]}, "input_embeds:"),
    ({"routed_dp_rank": 1}, "routed_dp_rank:"),  # one worker: rank 0 only
    ({"priority": 2**70}, "priority:"),  # inert, but range-checked as SGLang does
    ({"log_metrics": "yes"}, "log_metrics:"),  # inert, but typed
    ({"tempreature": 0.7}, "tempreature: not a /generate field"),  # unknown
    ({"sampling_params": {"max_new_tokens": 2, "sampling_seed": 2**64}}, "sampling_params.sampling_seed:"),
    ({"sampling_params": {"max_new_tokens": 2, "sampling_seed": -(2**64)}}, "sampling_params.sampling_seed:"),
    ({"sampling_params": {"max_new_tokens": 2, "sampling_seed": 2**63}}, "sampling_params.sampling_seed:"),
    ({"sampling_params": {"max_new_tokens": 2, "top_k": 2**40}}, "sampling_params.top_k:"),
    (
        {"sampling_params": {"max_new_tokens": 2, "stop_token_ids": [3, TINY["vocab_size"]]}},
        "sampling_params.stop_token_ids[1]:",
    ),
    ({"input_ids": [1, 2, TINY["vocab_size"]]}, "input_ids[2]: token id 97"),
    ({"input_ids": [1, 2**70]}, "input_ids[1]:"),
    ({"input_ids": [[1, 2], [3, TINY["vocab_size"]]]}, "input_ids[1][1]:"),
    ({"rid": "r" * 5000}, "rid:"),
]


@pytest.mark.fault("input")
def test_each_unimplemented_or_out_of_range_generate_field_is_a_400_naming_it(server):
    """Nothing of /generate is ignored: a LoRA adapter (never loaded here) is refused, not
    answered from the base model; an unimplemented field set, an unknown one, an integer that
    would overflow in torch or index past the vocabulary: each a 400 naming it (and its index),
    with nothing queued, the weights and the version as they were, and the server serving."""
    digest = _call(server.url, "GET", "/megatron_rl/weights_digest")[1]
    sp = {"max_new_tokens": 2}
    for extra, field in BAD_GENERATE:
        body = {"input_ids": prompt(5, 3), "sampling_params": sp, **extra}
        if isinstance(body["input_ids"][0], list):
            body["sampling_params"] = [sp] * len(body["input_ids"])
        status, out = _call(server.url, "POST", "/generate", body, timeout=30)
        assert status == 400 and field in out["message"], (extra, status, out)
    status, out = _call(server.url, "POST", "/generate", {"input_ids": [1], "lora_path": _ADAPTER})
    assert _ADAPTER in out["message"], out  # the adapter asked for is named
    info = _call(server.url, "GET", "/server_info")[1]
    state = info["internal_states"][0]
    assert (state["num_waiting_reqs"], state["num_running_reqs"]) == (0, 0), state
    assert info["weight_version"] == "0", info
    assert _call(server.url, "GET", "/megatron_rl/weights_digest")[1] == digest
    assert _generate(server.url)[0] == 200


@pytest.mark.fault("input")
def test_generate_fields_at_their_off_values_or_inert_are_served(server):
    """What changes nothing is accepted: the unimplemented fields at their off values (null,
    false, -1, per-prompt lists of them) and the inert ones (priority, metrics and logging flags,
    tracking ids), and the extreme seeds SGLang takes; the tokens are those of the plain request."""
    sp = {"max_new_tokens": 4, "sampling_seed": 11}
    plain = {"input_ids": prompt(5, 4), "sampling_params": sp}
    status, want = _call(server.url, "POST", "/generate", plain)
    assert status == 200, want
    neutral = {
        "lora_path": None,
        "lora_id": None,
        "return_hidden_states": False,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "routed_dp_rank": 0,
        "input_embeds": None,
        "modalities": [],
        "priority": 5,
        "log_metrics": False,
        "no_logs": True,
        "session_id": "s",
        "conversation_id": "c",
        "custom_labels": {"team": "rl"},
        "model": None,  # what sglang-router forwards
    }
    status, out = _call(server.url, "POST", "/generate", {**plain, **neutral})
    assert status == 200 and out["output_ids"] == want["output_ids"], out
    batch = {
        "input_ids": [prompt(5, 4)] * 2,
        "sampling_params": [sp] * 2,
        "lora_path": [None, None],
        "return_logprob": [True, True],
    }
    status, out = _call(server.url, "POST", "/generate", batch)
    assert status == 200 and [o["output_ids"] for o in out] == [want["output_ids"]] * 2, out
    for seed in (-(2**63), 2**63 - 1):
        body = {"input_ids": prompt(5, 4), "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed}}
        assert _call(server.url, "POST", "/generate", body)[0] == 200, seed


def test_the_generate_fields_are_sglangs():
    """Every top-level key the server knows is a field of SGLang 0.5.23's ``GenerateReqInput``
    (but ours, FLAT_LOGPROBS, and sglang-router's ``model``), and every field of it is known:
    implemented, inert or refused unless off, none ignored. A new SGLang field fails here until
    it is given one of the three."""
    root = os.environ.get("MEGATRON_RL_SGLANG_SRC") or REPO / ".cache" / f"sglang-{SGLANG_VERSION}"
    path = Path(root) / "sglang" / "srt" / "managers" / "io_struct.py"
    if not path.is_file():
        pytest.skip(f"no SGLang source at {path} (tests/generation/test_sglang_contract.py says how)")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput"]
    fields = {
        s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }
    ours = {FLAT_LOGPROBS} | ROUTER_FIELDS
    assert _GENERATE_KEYS - ours == fields, (_GENERATE_KEYS ^ fields) - ours
    assert not set(_GENERATE_INERT) & set(_GENERATE_OFF)


# ---------------------------------------------------------------------- dtypes


@pytest.fixture(scope="module")
def hf_weights(tiny_llama) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny_llama) / "model.safetensors"))


def _cast_case(hf: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    name = sorted(hf)[0]
    assert hf[name].dtype == torch.float32  # the tiny model is fp32
    return name, (hf[name] + 0.5).half()


@pytest.mark.fault("numeric")
def test_a_tensor_in_another_dtype_is_cast_and_the_reply_says_so(server, hf_weights):
    """fp16 into an fp32 model: cast, as SGLang's loaders ``copy_`` it (and as the trainer's
    ``weight_sync.cast_dtype`` relies on), and the reply names the tensor and both dtypes."""
    name, half = _cast_case(hf_weights)
    assert _call(server.url, "POST", "/begin_weight_update", {})[0] == 200
    try:
        body = update_weights_from_tensor_payload([serialize_named_tensors([(name, half)])], weight_version=3)
        status, out = _call(server.url, "POST", "/update_weights_from_tensor", body)
        assert status == 200 and out["dtype_casts"] == {"float16 -> float32": 1}, out
        assert f"float16 -> float32 (first {name})" in out["message"], out
        digest = _call(server.url, "GET", "/megatron_rl/weights_digest")[1]
        assert digest[name] == tensor_digest(half.float())
        # In the model's own dtype: nothing cast, nothing said.
        body = update_weights_from_tensor_payload(
            [serialize_named_tensors([(name, hf_weights[name])])], weight_version=0
        )
        status, out = _call(server.url, "POST", "/update_weights_from_tensor", body)
        assert status == 200 and out["dtype_casts"] == {} and "Cast" not in out["message"], out
    finally:
        assert _call(server.url, "POST", "/end_weight_update", {})[0] == 200


@pytest.mark.fault("numeric")
def test_a_broadcast_update_in_another_dtype_is_cast_and_the_reply_says_so(server, hf_weights):
    name, half = _cast_case(hf_weights)
    group = _Group(server.url, "hostile_cast")
    assert _call(server.url, "POST", "/begin_weight_update", {})[0] == 200
    try:
        for flattened in (True, False):
            status, out = group.update([(name, half)], flattened=flattened, version=4)
            assert status == 200 and out["dtype_casts"] == {"float16 -> float32": 1}, out
            assert name in out["message"] and "float16 -> float32" in out["message"], out
        status, out = group.update([(name, hf_weights[name])], flattened=True, version=0)
        assert status == 200 and out["dtype_casts"] == {}, out
    finally:
        _call(server.url, "POST", "/end_weight_update", {})
        group.close()


# ---------------------------------------------------------------------- arguments


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", "serve-engine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    """A model folder with a config.json and no weights: loading it would fail, so an error
    naming a flag proves the flag was checked before the model was loaded."""
    folder = tmp_path_factory.mktemp("config_only")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    return str(folder)


BAD_ARGS: list[tuple[list[str], str, int]] = [
    (["--port", "70000"], "--port", 2),
    (["--port", "-1"], "--port", 2),
    (["--port", "http"], "--port", 2),
    (["--max-len", "-5"], "--max-len", 2),
    (["--max-len", "1"], "--max-len", 2),
    (["--max-slots", "0"], "--max-slots", 2),
    (["--threads", "-1"], "--threads", 2),
    (["--weight-version", "-1"], "--weight-version", 2),
    (["--max-body-mb", "0"], "--max-body-mb", 2),
    (["--max-body-mb", "-1"], "--max-body-mb", 2),
    (["--max-body-mb", "nan"], "--max-body-mb", 2),
    (["--read-timeout-s", "0"], "--read-timeout-s", 2),
    (["--read-timeout-s", "inf"], "--read-timeout-s", 2),
    (["--max-conns-per-client", "-1"], "--max-conns-per-client", 2),
    (["--api-key", "two words"], "--api-key", 2),
    (["--host", "192.0.2.1"], "--host", 2),  # TEST-NET-1: an address, not this machine's
    (["--timing-model", "/no/such/timing.json"], "--timing-model", 3),
    (["--port-file", "/no/such/folder/port"], "--port-file", 4),
]


@pytest.mark.slow  # twenty-odd processes, each importing torch
@pytest.mark.fault("input")
def test_each_bad_argument_is_one_line_naming_its_flag(config_only, tmp_path):
    bad_json = tmp_path / "timing.json"
    bad_json.write_text("{not json")
    cases = [
        *BAD_ARGS,
        (["--timing-model", str(bad_json)], "--timing-model", 3),
        (["--model", str(tmp_path / "no_such_model")], "--model", 3),
    ]
    with ThreadPoolExecutor(2) as pool:  # each case is a process that imports torch
        runs = pool.map(
            lambda c: _serve(*([] if "--model" in c[0] else ["--model", config_only]), *c[0]), cases
        )
        results = list(zip(cases, runs))
    for (extra, flag, code), r in results:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code, (extra, r.returncode, r.stderr)
        assert len(lines) == 1 and "Traceback" not in r.stderr and flag in lines[0], (extra, r.stderr)
    r = _serve("--port", "1")  # --model missing
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--model" in r.stderr


@pytest.mark.fault("input")
def test_a_port_in_use_is_a_resource_error_before_the_model_loads(config_only):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve("--model", config_only, "--port", str(port))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 5, r.stderr  # errors.EXIT_RESOURCE
    assert len(lines) == 1 and "Traceback" not in r.stderr and f"--port {port}" in lines[0], r.stderr
