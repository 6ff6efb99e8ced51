"""Scoring that spans nodes: real verifier servers (in this process or as ``megatron-rl
verifier-server``), real pools, real HTTP on 127.0.0.1 -- no mocks."""

import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import wait
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.config import ConfigError, ConfigFieldError, config_from_dict
from megatron_rl.errors import UsageError
from megatron_rl.rewards.compose import RewardConfig, RewardInput, hard_timeout_s, score
from megatron_rl.rewards.math import MathConfig, brace_depth
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool
from megatron_rl.rewards.remote import VerifierFleet, verifier_pool
from megatron_rl.rewards.remote_server import VerifierServer

ROOT = Path(__file__).resolve().parents[2]
THINK = "<think>We need to add two and three together, which gives five in total.</think>"
CFG = RewardConfig(math=MathConfig(verdict_cache=0))  # every sample really verified, where it runs


def samples(n):
    """Math samples, right, wrong and malformed, as a scoring batch has them."""
    out = []
    for i in range(n):
        completion = THINK + f"Adding them up gives the result $\\boxed{{{i % 7}}}$."
        if i % 5 == 4:
            completion = f"The answer is $\\boxed{{{i % 7}}}$ without thinking first."
        out.append(
            RewardInput(
                problem="What is the sum of two and three? Give the exact value.",
                completion=completion,
                task="math",
                answer=str(i % 3),
                num_tokens=100 + i,
            )
        )
    return out


def submit(pool, inputs, cfg=CFG):
    return pool.submit_many(
        score, [(x, cfg) for x in inputs], timeout_s=[hard_timeout_s(x, cfg) for x in inputs]
    )


def outcomes(futures, timeout=120):
    _, pending = wait(futures, timeout=timeout)
    assert not pending, f"{len(pending)} futures still pending"
    return [f.exception() or f.result() for f in futures]


def post(url, body, headers=None, raw=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", "/score", body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    return resp.status, resp.read().decode(), conn


def health(url):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def start_cli_server(*args, port=0):
    """``megatron-rl verifier-server`` (on a free port); (process, url) once it says its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl", "verifier-server", "--port", str(port), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"no URL from the server: {line!r} {proc.stderr.read()}")
    return proc, line.split()[2]


@pytest.fixture(scope="module")
def server():
    with VerifierServer(1).start() as srv:
        yield srv


@pytest.fixture(scope="module")
def fleet(server):
    with VerifierFleet([server.url], 1) as f:
        assert f.wait_ready(120)
        yield f


def test_scores_through_a_server_equal_the_local_pools(server, fleet):
    inputs = samples(40)
    with VerifierPool(1) as local:
        expected = [r.to_json() for r in outcomes(submit(local, inputs))]
    sent = fleet.remote_stats["answered"]
    got = outcomes(submit(fleet, inputs))
    assert [r.to_json() for r in got] == expected
    assert fleet.remote_stats["answered"] > sent  # some went to the server, some ran here
    assert fleet.servers()[0]["state"] == "up"
    # Anything but the built-in reward runs locally.
    assert fleet.submit(brace_depth, "{{x}}").result(timeout=60) == 2
    assert fleet.map(brace_depth, [("{a}",), ("b",)]) == [1, 0]


def test_config_lists_servers_and_names_a_bad_one():
    assert RewardConfig(remote=["http://node7:8400", "http://10.0.0.2:8400/"]).remote
    with pytest.raises(ConfigFieldError, match=r"remote\[1\]: must be http://HOST:PORT"):
        RewardConfig(remote=["http://a:1", "https://b:2"])
    with pytest.raises(ConfigFieldError, match=r"remote\[1\]: the same server as remote\[0\]"):
        RewardConfig(remote=["http://a:1", "http://a:1/"])
    with pytest.raises(ConfigError, match=r"reward\.remote\[0\]: must be http://HOST:PORT"):
        config_from_dict(RewardConfig, {"remote": ["http://a"]}, prefix="reward.")
    with pytest.raises(ConfigFieldError, match="remote_api_key_env"):
        RewardConfig(remote_api_key_env="NOT A NAME")
    assert type(verifier_pool(RewardConfig(workers=1))) is VerifierPool  # no servers: the plain pool


@pytest.mark.fault("input")
def test_a_malformed_body_is_a_400_naming_the_field(server):
    good = {
        "id": "a",
        "input": {"problem": "p", "completion": "c", "task": "math", "answer": "1"},
        "timeout_s": 5,
    }
    bad_task = {**good, "id": "b", "input": {**good["input"], "task": "poem"}}
    cases = [
        (
            {"reward": {}, "tasks": [good, bad_task]},
            r"tasks\[1\]\.input\.task: must be one of \['math', 'code'\]",
        ),
        ({"reward": {}, "tasks": []}, "tasks: must be a non-empty list"),
        ({"reward": {"l_max": 0}, "tasks": [good]}, r"reward\.l_max: must be in"),
        ({"reward": {"math": {"parse_timeout_s": "x"}}, "tasks": [good]}, r"reward\.math\.parse_timeout_s"),
        ({"reward": {}, "tasks": [{**good, "timeout_s": -1}]}, r"tasks\[0\]\.timeout_s: must be a number"),
        ({"reward": {}, "tasks": [good, good]}, r"tasks\[1\]\.id: 'a' is used twice"),
        ({"reward": {}, "tasks": [{**good, "input": {"problem": "p"}}]}, r"tasks\[0\]\.input"),
        ({"reward": {"custom": "os:system"}, "tasks": [good]}, r"reward\.custom: 'os:system' is not allowed"),
        ({"reward": {}, "tasks": [good], "extra": 1}, "extra: unknown field"),
    ]
    queued = server.stats["tasks"]
    for body, message in cases:
        status, text, conn = post(server.url, body)
        conn.close()
        assert status == 400, (body, text)
        assert re.search(message, json.loads(text)["error"]), text
    status, text, _ = post(server.url, None, raw=b"{not json")
    assert status == 400 and "body: not JSON" in text
    assert server.stats["tasks"] == queued  # nothing of a bad body was queued
    # Too many tasks, or a body past the limit (refused before it is read).
    status, text, _ = post(server.url, {"reward": {}, "tasks": [{**good, "id": str(i)} for i in range(1025)]})
    assert status == 413 and "limit of 1024" in text
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/score")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "over the limit" in resp.read().decode()


@pytest.mark.fault("abuse")
def test_a_server_with_a_key_refuses_a_client_without_it():
    with VerifierServer(1, api_key="s3cret-key").start() as srv:
        assert health(srv.url)[0] == 200  # /health needs no key
        status, text, _ = post(srv.url, {"reward": {}, "tasks": []}, headers={"Authorization": "Bearer nope"})
        assert status == 401 and "API key" in text
        inputs = samples(6)
        with VerifierFleet([srv.url], 1) as keyless:
            assert keyless.wait_ready(120)
            got = outcomes(submit(keyless, inputs))  # nothing hangs: every future ends
            refused = [r for r in got if isinstance(r, PoolTaskError)]
            assert refused, "some tasks should have gone to the server"
            for e in refused:
                assert e.reason == "verifier_error" and "401" in e.detail and srv.url in e.detail
            assert keyless.servers()[0]["state"] == "refused"
            # It is never asked again: later tasks run locally and are scored.
            assert all(not isinstance(r, Exception) for r in outcomes(submit(keyless, inputs)))
        with VerifierFleet([srv.url], 1, api_key="s3cret-key") as keyed:
            assert keyed.wait_ready(120)
            assert all(not isinstance(r, Exception) for r in outcomes(submit(keyed, inputs)))
            assert keyed.remote_stats["answered"] > 0
    with pytest.raises(UsageError, match="needs an API key"):
        VerifierServer(1, host="0.0.0.0")


def test_deadline_is_an_upper_bound_with_tasks_away(fleet):
    assert fleet.deadline() == pytest.approx(VerifierPool.deadline(fleet), abs=1.0)  # nothing away
    futures = submit(fleet, samples(30))
    deadline = fleet.deadline()
    # The tasks away add their bound and the network allowance to the local pool's own.
    assert deadline > VerifierPool.deadline(fleet) + 40
    outcomes(futures)
    assert time.monotonic() <= deadline


def test_a_request_too_large_for_a_server_runs_locally():
    big = RewardInput(
        problem="What is the sum of two and three?",
        completion=THINK + " " + "so " * 400_000 + "the result is $\\boxed{5}$.",
        task="math",
        answer="5",
    )
    with VerifierServer(1, max_body_mb=1).start() as srv, VerifierFleet([srv.url], 1, local_share=False) as f:
        assert f.wait_ready(120)
        (result,) = outcomes(submit(f, [big]))
        assert result.correct and f.remote_stats["rerouted"] == 1 and f.remote_stats["answered"] == 0
        assert f.servers()[0]["state"] == "up"  # still in use for what fits
        assert all(not isinstance(r, Exception) for r in outcomes(submit(f, samples(4))))
        assert f.remote_stats["answered"] == 4


def test_a_server_that_is_down_leaves_everything_local():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with VerifierFleet([f"http://127.0.0.1:{port}"], 1, probe_interval_s=0.2) as f:
        assert not f.wait_ready(120)
        assert f.servers()[0]["state"] == "down" and "refused" in str(f.servers()[0]["why"]).lower()
        got = outcomes(submit(f, samples(10)))
        assert all(not isinstance(r, Exception) for r in got) and f.remote_stats["sent"] == 0


@pytest.mark.fault("crash")
def test_close_with_cancel_leaves_no_future_pending_and_the_server_drops_the_rest(server):
    f = VerifierFleet([server.url], 1)
    assert f.wait_ready(120)
    cancelled = server.stats["cancelled"]
    futures = submit(f, samples(200))
    until = time.monotonic() + 60
    while server.health()["queued"] < 20 and time.monotonic() < until:
        time.sleep(0.01)
    f.close(cancel=True)
    assert all(x.done() for x in futures)
    for x in futures:
        assert (
            x.cancelled() or not isinstance(x.exception(), Exception) or x.exception().reason == "cancelled"
        )
    # The server saw its client go and cancelled the tasks it had not started.
    while server.health()["queued"] and time.monotonic() < until:
        time.sleep(0.05)
    assert server.health()["queued"] == 0 and server.stats["cancelled"] > cancelled


@pytest.mark.slow
@pytest.mark.fault("crash")
def test_a_server_killed_mid_batch_loses_nothing():
    proc, url = start_cli_server("--workers", "1")
    try:
        with VerifierFleet([url], 1, probe_interval_s=0.2) as f:
            assert f.wait_ready(120)
            inputs = samples(200)
            futures = submit(f, inputs)
            deadline = f.deadline()
            until = time.monotonic() + 60
            while health(url)[1]["queued"] < 10 and time.monotonic() < until:
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)  # its verifier processes die with it
            got = outcomes(futures)
            assert time.monotonic() <= deadline
            assert f.remote_stats["lost"] == 1 and f.remote_stats["rerouted"] > 0
            assert f.servers()[0]["state"] == "down"
            assert [r.to_json() for r in got] == [score(x, CFG).to_json() for x in inputs]
            # Back on its port, it is found by the next /health and takes tasks again.
            proc.wait(timeout=30)
            proc, _ = start_cli_server("--workers", "1", port=int(url.rsplit(":", 1)[1]))
            until = time.monotonic() + 60
            while f.servers()[0]["state"] != "up" and time.monotonic() < until:
                time.sleep(0.05)
            answered = f.remote_stats["answered"]
            assert all(not isinstance(r, Exception) for r in outcomes(submit(f, samples(20))))
            assert f.remote_stats["answered"] > answered
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_cli_serves_health_and_exits_0_on_sigterm():
    proc, url = start_cli_server("--workers", "1")
    try:
        status, body = health(url)
        assert status == 200 and body == {"workers": 1, "queued": 0, "broken": None}
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "stopped" in out and "Traceback" not in err
    finally:
        proc.kill()


@pytest.mark.fault("input")
def test_cli_bad_flags_are_one_line(capsys, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    for args, message in [
        (["--workers", "0"], "--workers: must be an integer in [1, 4096], got 0"),
        (["--port", "70000"], "--port: must be an integer in [0, 65535] (0: any free port), got 70000"),
        (["--api-key-env", "NO_SUCH_KEY_VAR"], "NO_SUCH_KEY_VAR: that environment variable is not set"),
        (["--host", "0.0.0.0", "--port", "0", "--workers", "1"], "needs an API key"),
        (["--allow-custom", "no_such_module_xyz:fn", "--port", "0"], "--allow-custom no_such_module_xyz:fn"),
        (["--bogus"], "unrecognized arguments"),
    ]:
        assert cli_main(["verifier-server", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert os.environ.get("NO_SUCH_KEY_VAR") is None
