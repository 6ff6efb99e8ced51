"""The fleet behind the real sglang-router (the release ``protocol.ROUTER_VERSION`` pins), in front
of two real ``serve-engine`` processes, all on this machine.

sglang-router forwards ``/generate`` and answers ``/health``, but has no ``/abort_request``,
``/pause_generation`` or ``/server_info``. What a user of the router relies on: generations go
through it with the key; a request past its timeout ends at the worker that runs it (the client
aborts it at the workers; the router also cancels the upstream request when the client hangs
up); ``abort()`` and pause/resume reach the workers (``abort()`` at the router was a 404); the
weight-update group counts the workers, not the router.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import FleetClient
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.generation.protocol import router_launch_args
from tests.generation.conftest import free_port, prompt

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[router]')")
pytestmark = pytest.mark.distributed  # real server processes

KEY = "router-test-key"


def _state(url: str) -> dict:
    req = urllib.request.Request(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["internal_states"][0]


@pytest.fixture(scope="module")
def fleet_urls(tiny_llama, tmp_path_factory):
    """Two engines and the router in front of them: (router url, [worker urls])."""
    logs = tmp_path_factory.mktemp("router")
    with (
        EngineProcess(tiny_llama, max_slots=8, max_len=256, api_key=KEY) as a,
        EngineProcess(tiny_llama, max_slots=8, max_len=256, api_key=KEY) as b,
    ):
        port = free_port()
        with open(logs / "router.log", "wb") as log:
            router = subprocess.Popen(
                [
                    sys.executable, "-m", "sglang_router.launch_router",
                    "--worker-urls", a.url, b.url,
                    "--host", "127.0.0.1", "--port", str(port),
                    "--policy", "round_robin",
                    f"--api-key={KEY}",
                    # Its metrics exporter binds a port of its own (0.0.0.0:29000 by default).
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    *router_launch_args(request_timeout_s=60.0),
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert router.poll() is None, f"router exited: {(logs / 'router.log').read_text()[-2000:]}"
                try:
                    urllib.request.urlopen(url + "/health", timeout=5).read()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "router did not answer /health in 120 s"
                    time.sleep(0.2)
            yield url, [a.url, b.url]
        finally:
            if router.poll() is None:
                os.killpg(router.pid, signal.SIGTERM)
                router.wait(30)


def test_generations_through_the_router_reach_both_workers(fleet_urls):
    router, workers = fleet_urls
    before = [_state(w)["generated_tokens"] for w in workers]
    with FleetClient([router], update_urls=workers, api_key=KEY) as fleet:
        assert fleet.update_world_size() == 1 + len(workers)  # the router takes no rank
        reqs = [
            GenRequest(request_id=f"r{i}", input_ids=prompt(8, i), max_new_tokens=6, seed=i)
            for i in range(32)
        ]
        results = list(fleet.generate(reqs))
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in reqs)
    assert all(len(r.token_ids) == 6 and len(r.logprobs) == 6 for r in results)
    after = [_state(w)["generated_tokens"] for w in workers]
    assert all(y > x for x, y in zip(before, after)), (
        f"round robin should use both workers: {before} -> {after}"
    )


def test_timed_out_request_is_aborted_at_its_worker(fleet_urls):
    """Workers paused (the pause reaches them, not the router): a request waits there past the
    client's timeout; its abort must reach the worker, so nothing is left after resume."""
    router, workers = fleet_urls
    with FleetClient([router], update_urls=workers, api_key=KEY, request_timeout_s=2.0) as fleet:
        aborted_before = sum(_state(w)["aborted_requests"] for w in workers)
        fleet.pause()
        assert all(_state(w)["paused"] for w in workers)
        result = fleet.submit(
            GenRequest(request_id="slow", input_ids=prompt(8, 99), max_new_tokens=200)
        ).result(timeout=120)
        assert result.finish_reason == "abort" and result.meta["timed_out"]
        assert fleet.timed_out == [("slow", router)]
        deadline = time.monotonic() + 60
        while sum(_state(w)["aborted_requests"] for w in workers) == aborted_before:
            assert time.monotonic() < deadline, "the worker never saw the abort"
            time.sleep(0.1)
        fleet.resume()
        states = [_state(w) for w in workers]
        assert all(s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 for s in states), states


def test_abort_all_through_a_router_reaches_the_workers(fleet_urls):
    router, workers = fleet_urls
    with FleetClient([router], update_urls=workers, api_key=KEY) as fleet:
        fleet.pause()
        futs = [
            fleet.submit(GenRequest(request_id=f"q{i}", input_ids=prompt(8, 200 + i), max_new_tokens=100))
            for i in range(4)
        ]
        deadline = time.monotonic() + 60
        while sum(_state(w)["num_waiting_reqs"] + _state(w)["num_running_reqs"] for w in workers) < 4:
            assert time.monotonic() < deadline, "requests did not reach the workers"
            time.sleep(0.05)
        fleet.abort()  # the router has no /abort_request: this used to raise a 404
        results = [f.result(timeout=120) for f in futs]
        fleet.resume()
    assert all(r.finish_reason == "abort" for r in results)


def test_router_without_the_key_is_refused(fleet_urls):
    """The router passes the client's credentials on; without them the workers refuse."""
    router, _ = fleet_urls
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode()
    req = urllib.request.Request(
        router + "/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
