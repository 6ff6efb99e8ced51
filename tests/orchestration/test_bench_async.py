"""``megatron-rl bench async`` as a user runs it: the real orchestrator in both loop modes against
timing-model engine servers, on a small long-tailed workload, with every cost given on the command
line so nothing is calibrated (~20 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.orchestration.conftest import ROOT

pytestmark = pytest.mark.slow

SMALL = [
    "--steps",
    "3",
    "--servers",
    "2",
    "--slots",
    "16",
    "--l-max",
    "256",
    "--median-len",
    "32",
    "--decode-ms",
    "5",
    "--decode-ms-per-seq",
    "0.05",
    "--prefill-ms-per-token",
    "0.005",
    "--train-ms",
    "0",
    "--train-ms-per-token",
    "0.1",
    "--n-batch",
    "32",
    "--n-async",
    "64",
    "--group-size",
    "8",
]


def _bench(*argv: str) -> list[str]:
    """``megatron-rl bench ARGV`` as a user runs it: exit 0, its printed lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_bench_async_runs_both_loops_and_async_keeps_the_generators_fuller():
    lines = _bench("async", *SMALL)
    out = json.loads(lines[-1])
    assert out["mode"] == "timing-model"
    assert any(line.startswith("mode: timing-model") for line in lines)  # the table says so too
    for mode in ("sync", "async"):
        assert 0.0 <= out[f"generator_busy_{mode}"] <= 1.0
        assert 0.0 <= out[f"client_busy_{mode}"] <= 1.0
        assert 0.0 < out[f"slot_occupancy_{mode}"] <= 1.0
        # The same work in both loops: 3 steps of 32 sequences.
        assert out[f"trained_sequences_{mode}"] == 3 * 32
    assert out["staleness_mean_sync"] == 0.0  # a sync batch is on-policy
    # Counts, not clocks: a sync step's tail decodes a nearly empty batch.
    assert out["slot_occupancy_async"] > out["slot_occupancy_sync"]
    # The speed-up itself is a benchmark figure (README), not a test assertion.
    assert out["async_speedup"] > 0.0


def test_async_only_runs_the_async_loop_alone():
    """``--async-only``: what a comparison of two versions of the orchestrator reruns (~10 s)."""
    out = json.loads(_bench("async", "--async-only", *SMALL)[-1])
    assert out["loop_modes"] == "async" and not any(k.endswith("_sync") for k in out)
    assert out["trained_sequences_async"] == 3 * 32 and out["client_cpu_ms_per_completion_async"] > 0


def test_bench_scale_sweeps_fleet_sizes_and_loses_nothing():
    """``megatron-rl bench scale`` at two tiny fleet sizes, groups in one request each: a row per
    size with the orchestrator's cost figures, nothing lost or timed out (~40 s)."""
    lines = _bench(
        "scale",
        "--servers",
        "1,2",
        "--slots",
        "16",
        "--steps",
        "2",
        "--group-size",
        "8",
        "--decode-ms",
        "5",
        "--l-max",
        "128",
        "--median-len",
        "24",
        "--group-requests",
    )
    out = json.loads(lines[-1])
    assert [r["servers"] for r in out["rows"]] == [1, 2]
    assert [r["in_flight"] for r in out["rows"]] == [16, 32]
    for r in out["rows"]:
        assert r["completions_per_s"] > 0 and r["cpu_ms_per_completion"] > 0
        assert 0 < r["async_efficiency"] and r["update_ms_max"] >= r["update_ms_mean"] > 0
    assert out["lost"] == 0 and out["timed_out"] == 0 and out["group_requests"] is True
    assert out["max_servers_95"] >= 0
