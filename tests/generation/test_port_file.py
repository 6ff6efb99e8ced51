"""serve-engine's --port-file: written atomically, and never over a file the server did not write
(issue 49: ``--port-file M/config.json`` once replaced the model's config with a port number)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.errors import OutputError
from megatron_rl.generation.engine.serve_args import write_port_file

pytestmark = [pytest.mark.fault("input")]


def test_an_absent_path_is_written_whole(tmp_path):
    write_port_file(str(tmp_path / "port"), 30001)
    assert (tmp_path / "port").read_text() == "30001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["port"]  # no temporary left


@pytest.mark.parametrize("stale", ["30000", "8\n", "65535"])
def test_an_earlier_servers_port_file_is_replaced(tmp_path, stale):
    (tmp_path / "port").write_text(stale)
    write_port_file(str(tmp_path / "port"), 41234)
    assert (tmp_path / "port").read_text() == "41234"


@pytest.mark.parametrize(
    "content", [b'{"vocab_size": 121}\n', b"", b"123456", b"30000\n\n", b"port=30000", b"\xff\xfe"]
)
def test_a_file_that_is_not_a_port_file_is_never_replaced(tmp_path, content):
    user = tmp_path / "config.json"
    user.write_bytes(content)
    with pytest.raises(OutputError, match=r"--port-file .*config.json: exists and is not a port file"):
        write_port_file(str(user), 30001)
    assert user.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_symlink_or_folder_is_never_replaced(tmp_path):
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"30000")  # even a target that would pass as a port file
    os.symlink(target, tmp_path / "port")
    with pytest.raises(OutputError, match="exists and is not a regular file"):
        write_port_file(str(tmp_path / "port"), 30001)
    assert os.path.islink(tmp_path / "port") and target.read_bytes() == b"30000"
    (tmp_path / "dir").mkdir()
    with pytest.raises(OutputError, match="exists and is not a regular file"):
        write_port_file(str(tmp_path / "dir"), 30001)


@pytest.mark.distributed  # a real server process
def test_a_restarted_server_replaces_its_stale_port_file_and_no_connection_limit_serves(tmp_path, tiny_llama):
    """``--port-file`` of a server that died (its old port left in the file) is reused, and
    ``--max-conns-per-client 0`` means no limit: the server answers /generate."""
    port_file = tmp_path / "port"
    port_file.write_text("1")  # an earlier server's, on a port nobody listens on
    before = {p.name: p.read_bytes() for p in Path(tiny_llama).iterdir()}
    cmd = [sys.executable, "-m", "megatron_rl", "serve-engine", "--model", tiny_llama, "--port", "0"]
    cmd += ["--port-file", str(port_file), "--max-conns-per-client", "0", "--max-len", "64", "--threads", "1"]
    env = dict(os.environ, MEGATRON_RL_API_KEY="")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while port_file.read_text() == "1":
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the server never wrote its port"
            time.sleep(0.1)
        port = int(port_file.read_text())
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        conn.close()
        assert resp.status == 200 and len(out["output_ids"]) == 4, out
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert {p.name: p.read_bytes() for p in Path(tiny_llama).iterdir()} == before
