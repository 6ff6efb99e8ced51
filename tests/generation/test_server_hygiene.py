"""The engine server's hygiene over real HTTP: weight updates checked whole and applied all or
nothing, bounded bodies, strict sampling parameters (SGLang 0.5.23's names and ranges), a batch
queued whole or not at all, a departed client's request aborted, JSON errors without tracebacks,
a thousand connections at once, and an update-group store that listens on its address only."""

from __future__ import annotations

import ast
import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.engine.model import Decoder
from megatron_rl.generation.engine.requests import _SAMPLING_KEYS
from megatron_rl.generation.protocol import SGLANG_VERSION, init_group_payload, pack_bucket, tensor_digest
from megatron_rl.generation.update_group import broadcast, destroy_update_group, init_update_group
from tests.generation.conftest import TINY, free_port, prompt

pytestmark = pytest.mark.distributed  # a real server process (and a real gloo group below)

REPO = Path(__file__).resolve().parents[2]
MAX_LEN = 256
MAX_BODY_MB = 1


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[EngineProcess]:
    args = ["--max-body-mb", str(MAX_BODY_MB)]
    with EngineProcess(tiny_llama, max_slots=4, max_len=MAX_LEN, extra_args=args) as s:
        yield s


@pytest.fixture(scope="module")
def hf_weights(tiny_llama) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny_llama) / "model.safetensors"))


def _conn(url: str, timeout: float = 60) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _call(url: str, method: str, route: str, body: object = None) -> tuple[int, object]:
    """(status, JSON body) of one request; every answer, error or not, must be JSON without a
    traceback."""
    conn = _conn(url)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, route, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    _check_error_body(resp.status, raw)
    return resp.status, json.loads(raw)


def _check_error_body(status: int, raw: bytes) -> None:
    assert b"Traceback" not in raw, raw
    out = json.loads(raw)  # JSON, whatever the status
    if status >= 400:
        assert isinstance(out, dict) and isinstance(out["message"], str) and out["message"], out


def _generate(url: str, body: dict) -> tuple[int, dict]:
    status, out = _call(url, "POST", "/generate", body)
    assert isinstance(out, (dict, list))
    return status, out  # type: ignore[return-value]


def _state(url: str) -> dict:
    status, info = _call(url, "GET", "/server_info")
    assert status == 200 and isinstance(info, dict)
    return info["internal_states"][0]


def _wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``cond()`` until true; fail naming ``what`` at the deadline (no timing asserted)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------- weight updates


class _Group:
    """This process as rank 0 of the server's update group (as the trainer is)."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        port = free_port()
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                _call,
                url,
                "POST",
                "/init_weights_update_group",
                init_group_payload(
                    master_address="127.0.0.1",
                    master_port=port,
                    rank_offset=1,
                    world_size=2,
                    group_name=name,
                    backend="gloo",
                ),
            )
            self.group = init_update_group(
                backend="gloo",
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name=name,
            )
            assert joined.result(timeout=120)[0] == 200
        self.port = port

    def update(
        self, tensors: list[tuple[str, torch.Tensor]], *, flattened: bool, version: int
    ) -> tuple[int, dict]:
        """One ``/update_weights_from_distributed`` with its broadcast(s), as the trainer sends it."""
        if flattened:
            names, dtypes, shapes, flat = pack_bucket(tensors)
            sends = [flat]
        else:
            names = [n for n, _ in tensors]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
            shapes = [list(t.shape) for _, t in tensors]
            sends = [t.contiguous() for _, t in tensors]
        body: dict[str, object] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self.name,
            "weight_version": str(version),
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        with ThreadPoolExecutor(1) as pool:
            answer: Future = pool.submit(_call, self.url, "POST", "/update_weights_from_distributed", body)
            for t in sends:
                broadcast(t, self.group, src=0)
            return answer.result(timeout=120)

    def close(self) -> None:
        _call(self.url, "POST", "/destroy_weights_update_group", {"group_name": self.name})
        destroy_update_group(self.group)


@pytest.fixture(scope="module")
def group(server) -> Iterator[_Group]:
    g = _Group(server.url, "hygiene_weights")
    assert _call(server.url, "POST", "/begin_weight_update", {})[0] == 200
    yield g
    _call(server.url, "POST", "/end_weight_update", {})
    g.close()


def _listening(port: int) -> list[str]:
    """Local addresses listening on TCP ``port`` on this host, from ``/proc/net/tcp{,6}``."""
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            # The kernel writes the address as 32-bit words in host (little-endian) order.
            raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
            out.append(socket.inet_ntop(family, raw))
    return out


def test_the_update_store_listens_on_its_address_only(group):
    """Rank 0 (here, as the trainer) hosts the store: bound to 127.0.0.1, not every interface
    (torch's own TCPStore server would listen on ``::``)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs /proc/net/tcp")
    assert _listening(group.port) == ["127.0.0.1"]


def _half_valid(hf: dict[str, torch.Tensor]) -> dict[str, tuple[list[tuple[str, torch.Tensor]], str]]:
    """Buckets that each hold valid new tensors and one bad one, and the bad one's name."""
    names = sorted(hf)
    good = [(n, hf[n] + 0.25) for n in names[:2]]
    nan = hf[names[2]].clone()
    nan.view(-1)[3] = float("nan")
    inf = hf[names[2]].clone()
    inf.view(-1)[0] = float("inf")
    return {
        "nan": ([*good, (names[2], nan)], names[2]),
        "inf": ([*good, (names[2], inf)], names[2]),
        "shape": ([*good, (names[3], hf[names[3]].reshape(-1)[:-1].clone())], names[3]),
        "unknown": (
            [*good, ("model.layers.9.no_such.weight", torch.ones(4))],
            "model.layers.9.no_such.weight",
        ),
        "twice": ([*good, (names[0], hf[names[0]] - 1.0)], names[0]),
        "integer": ([*good, (names[4], torch.zeros(hf[names[4]].shape, dtype=torch.int32))], names[4]),
        # A value fine in float64 but past float32, the parameter's dtype.
        "overflow": ([*good, (names[2], hf[names[2]].double().fill_(1e300))], names[2]),
    }


@pytest.mark.fault("numeric")
@pytest.mark.parametrize("flattened", [True, False], ids=["bucket", "per_tensor"])
def test_a_half_valid_update_changes_nothing(server, group, hf_weights, flattened):
    before = _call(server.url, "GET", "/megatron_rl/weights_digest")[1]
    state0 = _state(server.url)
    version0 = _call(server.url, "GET", "/server_info")[1]["weight_version"]  # type: ignore[index]
    for case, (tensors, bad_name) in _half_valid(hf_weights).items():
        status, out = group.update(tensors, flattened=flattened, version=77)
        assert status == 400, (case, out)
        # The first bad tensor is named (the good ones before it are not).
        assert out["message"].startswith(f"{bad_name}:") and "nothing was applied" in out["message"], (
            case,
            out,
        )
        assert _call(server.url, "GET", "/megatron_rl/weights_digest")[1] == before, case
    info = _call(server.url, "GET", "/server_info")[1]
    assert info["weight_version"] == version0  # type: ignore[index]
    assert _state(server.url)["weight_updates"] == state0["weight_updates"]
    # The same group still works: a valid update is applied whole.
    new = [(n, hf_weights[n] + 0.5) for n in sorted(hf_weights)[:3]]
    status, out = group.update(new, flattened=flattened, version=78)
    assert status == 200, out
    after = _call(server.url, "GET", "/megatron_rl/weights_digest")[1]
    assert after == {**before, **{n: tensor_digest(t) for n, t in new}}  # type: ignore[dict-item]
    assert _call(server.url, "GET", "/server_info")[1]["weight_version"] == "78"  # type: ignore[index]
    # Put the original weights back for the other tests.
    assert group.update([(n, hf_weights[n]) for n, _ in new], flattened=flattened, version=0)[0] == 200


@pytest.mark.fault("input")
def test_a_bad_update_body_is_refused_before_any_receive(server, group):
    """No broadcast follows these: the server must answer without waiting for one."""
    base = {
        "names": ["a", "b"],
        "dtypes": ["float32", "float32"],
        "shapes": [[2], [2]],
        "group_name": group.name,
    }
    cases = {
        "names / dtypes / shapes": {**base, "dtypes": ["float32"]},
        "dtypes[1]": {**base, "dtypes": ["float32", "float99"]},
        "shapes[0]": {**base, "shapes": [[-1], [2]]},
        "names[0]": {**base, "names": [3, "b"]},
        "names": {**base, "names": []},
        "load_format": {**base, "load_format": "npz"},
        "weight_version": {**base, "weight_version": "v1"},
        "bucket": {
            **base,
            "dtypes": ["bfloat16", "float32"],
            "shapes": [[1], [2]],
            "load_format": "flattened_bucket",
        },
    }
    for field, body in cases.items():
        status, out = _call(server.url, "POST", "/update_weights_from_distributed", body)
        assert status == 400 and field in out["message"], (field, out)  # type: ignore[index]


# ---------------------------------------------------------------------- bodies and errors


def _raw(url: str, request: bytes, *, timeout: float = 60) -> tuple[int, bytes]:
    """Send raw bytes; return the status and body of the answer."""
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read()


@pytest.mark.fault("abuse")
def test_an_oversized_body_is_refused_unread(server):
    # A declared 10 GB that never comes: the answer comes without the server waiting for it.
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, raw = _raw(server.url, head + b"Content-Length: 10000000000\r\n\r\n")
    _check_error_body(status, raw)
    assert status == 413 and "max-body-mb" in json.loads(raw)["message"]
    # A body just over the limit, actually sent: 413 as well, and the client reads it.
    big = {"input_ids": [1] * (MAX_BODY_MB * 2**20 // 3), "sampling_params": {"max_new_tokens": 1}}
    status, out = _call(server.url, "POST", "/generate", big)
    assert status == 413, out
    for bad in (b"-1", b"abc", b"+5", b"5, 6"):
        status, raw = _raw(server.url, head + b"Content-Length: " + bad + b"\r\n\r\n")
        _check_error_body(status, raw)
        assert status == 400 and "Content-Length" in json.loads(raw)["message"], bad
    status, raw = _raw(server.url, head + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    _check_error_body(status, raw)
    assert status == 411
    assert _state(server.url)["num_waiting_reqs"] == 0  # still serving


@pytest.mark.fault("input")
def test_every_error_is_json_without_a_traceback(server):
    for method, route, body in [
        ("GET", "/no_such_route", None),
        ("POST", "/no_such_route", {}),
        ("PUT", "/generate", {}),
        ("DELETE", "/server_info", None),
        ("POST", "/update_weight_version", {}),
        ("POST", "/update_weight_version", {"new_version": [1]}),
        ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": None}),
        ("POST", "/abort_request", {"rid": {"a": 1}}),
    ]:
        status, _ = _call(server.url, method, route, body)  # asserts JSON, no traceback
        assert status in (200, 400, 404, 501), (method, route, status)
    nested = b"[" * 100_000 + b"]" * 100_000
    for request in [
        b"POST /generate HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(nested) + nested,
        b"POST /generate HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope",
        b"GARBAGE\r\n\r\n",
    ]:
        status, raw = _raw(server.url, request)
        _check_error_body(status, raw)
        assert status == 400


# ---------------------------------------------------------------------- sampling parameters

BAD_SAMPLING = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": True}, "top_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": "8"}, "max_new_tokens"),
    ({"top_k": 0}, "top_k"),  # SGLang refuses 0 too; -1 is its "off"
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"sampling_seed": "x"}, "sampling_seed"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stop": ["</s>"]}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"tempreature": 0.7}, "tempreature"),  # a typo is not silently ignored
    ({"n": 2}, "n"),
]


@pytest.mark.fault("input")
def test_each_bad_sampling_param_is_a_400_naming_it(server):
    for params, field in BAD_SAMPLING:
        status, out = _generate(server.url, {"input_ids": prompt(4, 1), "sampling_params": params})
        assert status == 400 and f"sampling_params.{field}:" in out["message"], (params, out)
    status, out = _generate(server.url, {"input_ids": prompt(4, 1), "sampling_params": {"n": 2}})
    assert "one request per sample" in out["message"]
    status, out = _generate(server.url, {"input_ids": prompt(4, 1), "sampling_params": [1]})
    assert status == 400
    # SGLang's "off" values and nulls are accepted.
    neutral = {
        "max_new_tokens": 3,
        "n": 1,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0,
        "repetition_penalty": 1.0,
        "ignore_eos": False,
        "stop": [],
        "temperature": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    status, out = _generate(server.url, {"input_ids": prompt(4, 1), "sampling_params": neutral})
    assert status == 200 and len(out["output_ids"]) == 3, out


def test_the_sampling_keys_are_sglangs():
    """Every key the server accepts is a field of SGLang 0.5.23's ``SamplingParams``, and every
    field it takes from callers is one the server knows (accepts, or refuses unless off)."""
    root = os.environ.get("MEGATRON_RL_SGLANG_SRC") or REPO / ".cache" / f"sglang-{SGLANG_VERSION}"
    path = Path(root) / "sglang" / "srt" / "sampling" / "sampling_params.py"
    if not path.is_file():
        pytest.skip(f"no SGLang source at {path} (tests/generation/test_sglang_contract.py says how)")
    text = path.read_text(encoding="utf-8")
    # The API fields come first; SGLang marks where its internal ones begin.
    internal = text.index("# --- Internal fields")
    (cls,) = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams"]
    fields = {
        stmt.target.id: len("\n".join(text.splitlines()[: stmt.lineno])) < internal
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    assert _SAMPLING_KEYS <= set(fields), _SAMPLING_KEYS - set(fields)
    api = {name for name, is_api in fields.items() if is_api}
    assert api <= _SAMPLING_KEYS, api - _SAMPLING_KEYS


def _lps(out: dict) -> list[float]:
    return [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def test_top_k_cuts_and_a_tiny_temperature_is_greedy(server, tiny_llama):
    ids = prompt(6, 11)
    greedy = _generate(
        server.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    )[1]
    # top_k=1 at temperature 1 is greedy, log-probs included (greedy reports temperature 1).
    top1 = _generate(
        server.url,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "top_k": 1, "sampling_seed": 5},
        },
    )[1]
    assert top1["output_ids"] == greedy["output_ids"]
    torch.testing.assert_close(torch.tensor(_lps(top1)), torch.tensor(_lps(greedy)), atol=1e-5, rtol=0)
    # Below SGLang's floor of 1e-6: greedy, finite log-probs.
    for t in (1e-7, 1e-30):
        tiny = _generate(
            server.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": t}}
        )[1]
        assert tiny["output_ids"] == greedy["output_ids"], t
        assert all(math.isfinite(lp) for lp in _lps(tiny)), t
        torch.testing.assert_close(torch.tensor(_lps(tiny)), torch.tensor(_lps(greedy)), atol=1e-5, rtol=0)
    # top_k=3 at a high temperature: every token among the 3 most likely, and its log-prob that of
    # the policy (the full-vocabulary tempered soft-max), not of the cut distribution.
    temperature = 3.0
    out = _generate(
        server.url,
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 40,
                "temperature": temperature,
                "top_k": 3,
                "sampling_seed": 1,
            },
        },
    )[1]
    toks = out["output_ids"]
    logits = Decoder.from_pretrained(tiny_llama).full_logits(torch.tensor([ids + toks]))[0, len(ids) - 1 : -1]
    top3 = logits.topk(3, -1).indices
    assert all(t in row for t, row in zip(toks, top3.tolist()))
    ref = torch.log_softmax(logits.float() / temperature, -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(_lps(out)), ref, atol=1e-5, rtol=0)
    assert len(set(toks)) > 1  # it did sample, not just take the argmax


# ---------------------------------------------------------------------- batches and clients


@pytest.fixture()
def paused(server) -> Iterator[None]:
    assert _call(server.url, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        yield
    finally:
        assert _call(server.url, "POST", "/continue_generation", {})[0] == 200


@pytest.mark.fault("input")
def test_a_batch_with_one_bad_prompt_queues_nothing(server, paused):
    """Paused, so that anything queued would still be waiting when we look."""
    good = prompt(5, 2)
    sp = {"max_new_tokens": 4}
    cases = [
        ({"input_ids": [good, [1, TINY["vocab_size"]]], "sampling_params": sp}, "prompt[1]: input_ids"),
        ({"input_ids": [good, good + [1] * MAX_LEN], "sampling_params": sp}, "prompt[1]: max_new_tokens"),
        ({"input_ids": [good, [1, True]], "sampling_params": sp}, "input_ids[1]"),
        ({"input_ids": [good, good], "sampling_params": [sp, {"top_p": 2}]}, "sampling_params[1].top_p"),
        ({"input_ids": [good, good], "rid": ["x", "x"], "sampling_params": sp}, "rid"),
        ({"input_ids": [good, good], "rid": ["x"], "sampling_params": sp}, "rid"),
    ]
    for body, field in cases:
        status, out = _generate(server.url, body)
        assert status == 400 and field in out["message"], (field, out)
        state = _state(server.url)
        assert (state["num_waiting_reqs"], state["num_running_reqs"]) == (0, 0), (field, state)


def _send_generate(url: str, body: dict) -> socket.socket:
    """Start a /generate on a raw socket and return it (unanswered, still open)."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data) + data
    )
    return sock


@pytest.mark.fault("crash")
def test_a_client_that_leaves_has_its_request_aborted(server, paused):
    body = {"input_ids": prompt(5, 3), "sampling_params": {"max_new_tokens": 200}}
    # Waiting (paused before it was admitted): the client leaves, the queue empties.
    gone0 = _state(server.url)["client_disconnects"]
    sock = _send_generate(server.url, {**body, "rid": "leaves-waiting"})
    _wait_for(lambda: _state(server.url)["num_waiting_reqs"] == 1, "the request to be queued")
    sock.close()
    _wait_for(lambda: _state(server.url)["num_waiting_reqs"] == 0, "the waiting request to be aborted")
    assert _state(server.url)["client_disconnects"] == gone0 + 1
    # Running (admitted, then paused in place holding its slot): the slot is freed.
    assert _call(server.url, "POST", "/continue_generation", {})[0] == 200
    sock = _send_generate(server.url, {**body, "rid": "leaves-running"})
    _wait_for(lambda: _state(server.url)["num_running_reqs"] == 1, "the request to run")
    assert _call(server.url, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    sock.close()
    _wait_for(lambda: _state(server.url)["num_running_reqs"] == 0, "the running request to be aborted")
    assert _state(server.url)["client_disconnects"] == gone0 + 2
    # The rid is free again and a client that stays is answered.
    assert _call(server.url, "POST", "/continue_generation", {})[0] == 200
    status, out = _generate(
        server.url, {**body, "rid": "leaves-running", "sampling_params": {"max_new_tokens": 3}}
    )
    assert status == 200 and len(out["output_ids"]) == 3


@pytest.mark.fault("load")
def test_a_thousand_connections_at_once(server):
    """1024 clients connect before any is answered (the listen backlog), then all are answered."""
    n = 1024
    parts = urllib.parse.urlsplit(server.url)
    socks = [socket.create_connection((parts.hostname, parts.port), timeout=120) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        statuses: list[int] = []

        def read(s: socket.socket) -> None:
            resp = http.client.HTTPResponse(s)
            resp.begin()
            resp.read()
            statuses.append(resp.status)

        threads = [threading.Thread(target=read, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert statuses.count(200) == n
    finally:
        for s in socks:
            s.close()


def _read_events(sock: socket.socket, want: int) -> list[dict]:
    """Read a streamed reply from ``sock`` until ``want`` data events (or [DONE]) have arrived."""
    buf, events = b"", []
    while len(events) < want:
        chunk = sock.recv(65536)
        assert chunk, f"the stream closed after {len(events)} events"
        buf += chunk
        head, sep, rest = buf.partition(b"\r\n\r\n")
        body = rest if sep else b""
        events = [
            json.loads(line[6:]) if line != b"data: [DONE]" else "DONE"
            for line in body.split(b"\n")
            if line.startswith(b"data: ")
        ]
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
    return events


@pytest.mark.fault("crash")
def test_a_streamed_batch_sends_each_item_as_it_finishes_and_a_client_that_leaves_aborts_the_rest(server):
    """``stream`` on a batch: one ``data:`` event per finished item with its ``index`` (the short
    one first), then ``[DONE]``; a client that closes after the first event has the rest aborted."""
    short, long_ = {"max_new_tokens": 2}, {"max_new_tokens": 200}
    body = {"input_ids": [prompt(5, 7), prompt(5, 7)], "sampling_params": [long_, short], "stream": True}
    sock = _send_generate(server.url, {**body, "sampling_params": [{"max_new_tokens": 6}, short]})
    events = _read_events(sock, 3)
    sock.close()
    assert [e["index"] for e in events[:2]] == [1, 0] and events[2] == "DONE", events
    assert [len(e["output_ids"]) for e in events[:2]] == [2, 6]
    gone0 = _state(server.url)["client_disconnects"]
    sock = _send_generate(server.url, {**body, "rid": ["stream-long", "stream-short"]})
    first = _read_events(sock, 1)
    assert first[0]["index"] == 1 and first[0]["meta_info"]["id"] == "stream-short", first
    assert _call(server.url, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200  # it still runs
    try:
        assert _state(server.url)["num_running_reqs"] == 1
        sock.close()
        _wait_for(lambda: _state(server.url)["num_running_reqs"] == 0, "the long request to be aborted")
        assert _state(server.url)["client_disconnects"] == gone0 + 1
    finally:
        assert _call(server.url, "POST", "/continue_generation", {})[0] == 200
    status, out = _generate(server.url, {**body, "stream": "yes"})
    assert status == 400 and "stream" in out["message"], out
