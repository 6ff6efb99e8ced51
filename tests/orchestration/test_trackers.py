"""run.trackers: a short real training run logs the same metrics, the resolved config and the
plots to W&B (offline) and MLflow (file store), each read back with that library's own code."""

from __future__ import annotations

import os
import struct
import subprocess

import pytest

from megatron_rl.config import ConfigFieldError
from megatron_rl.orchestration.config import RunDirConfig
from megatron_rl.orchestration.trackers import check_trackers
from tests.orchestration.conftest import ROOT, read_jsonl, recipe, train_cmd


def _wandb_records(path):
    """The protobuf records of an offline ``.wandb`` file (W&B's LevelDB-log framing: a 7-byte
    file header, 32 KiB blocks, records ``crc32 | length u16 | type u8 | data``), parsed with
    W&B's own ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, block, out, part = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        part = data if kind in (1, 2) else part + data
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
    return out


def test_unknown_tracker_is_refused_at_load_naming_the_field():
    with pytest.raises(ConfigFieldError, match="trackers"):
        RunDirConfig(trackers=["jsonl", "neptune"])
    with pytest.raises(ValueError, match="run.trackers: unknown tracker 'neptune'"):
        check_trackers(["neptune"])


def test_wandb_offline_and_mlflow_get_the_runs_metrics_config_and_plots(tmp_path, policy):
    import json

    path = recipe(
        tmp_path,
        policy,
        loop={"max_steps": 2},
        run={"trackers": ["jsonl", "wandb", "mlflow"], "wandb_project": "trackers-test"},
    )
    env = {**os.environ, "WANDB_MODE": "offline"}  # belt and braces: never the network
    proc = subprocess.run(train_cmd(path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]

    # W&B: one offline run under RUN/wandb, its history the steps of metrics.jsonl.
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    records = _wandb_records(files[0])
    rows = [
        {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
        for rec in records
        if rec.WhichOneof("record_type") == "history"
    ]
    history = [row for row in rows if "reward/mean" in row]
    assert [h["_step"] for h in history] == [1, 2]
    for h, m in zip(history, metrics):
        for key in ("reward/mean", "train/loss", "length/mean"):
            assert h[key] == pytest.approx(m[key]), key
    assert any(row.get("plots/training/_type") == "image-file" for row in rows)  # the plot
    config = [r for r in records if r.WhichOneof("record_type") == "config"]
    keys = {"/".join(i.nested_key) or i.key for c in config for i in c.config.update}
    assert {"loop", "algorithm", "reward"} <= keys

    # MLflow: the file store RUN/mlruns, read with MlflowClient.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").resolve().as_uri())
    run_id = (run / "mlruns" / "run_id").read_text().strip()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["loop.max_steps"] == "2" and got.data.params["fleet.api_key"] == ""
    hist = client.get_metric_history(run_id, "reward.mean")  # "/" is "." in MLflow
    assert [(h.step, h.value) for h in hist] == [
        (m["step"], pytest.approx(m["reward/mean"])) for m in metrics
    ]
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/training.png"]
