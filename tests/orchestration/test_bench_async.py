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


def test_bench_async_runs_both_loops_and_async_keeps_the_generators_fuller():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", "async", *SMALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
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
