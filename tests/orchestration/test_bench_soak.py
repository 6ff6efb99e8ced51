"""``megatron-rl bench soak`` at a size a test affords: a real run killed (SIGKILL to its process
group) and resumed trains every step once, n_batch sequences each and no group twice; the sampled
rows carry each process class; the checkpoints stay within their rotation; the plot is drawn.
Whether memory stays flat over thousands of steps is the bench's to measure (README "Scale");
its verdict is checked here on synthetic samples: jitter is flat, a leak is not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.orchestration.conftest import ROOT, read_jsonl


@pytest.mark.slow
@pytest.mark.fault("crash")
def test_a_killed_and_resumed_soak_loses_nothing(tmp_path, policy):
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "megatron_rl", "bench", "soak", "--steps", "14", "--kills", "1"]
    cmd += ["--checkpoint-every", "2", "--sample-s", "0.5", "--warmup-steps", "2", "--out", str(out)]
    cmd += ["--model", policy["model"], "--train", policy["train"]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res["killed_at"]) == 1 and 2 <= res["killed_at"][0] < 14, res
    assert res["nothing_lost"], res
    assert (res["trained_steps"], res["trained_sequences"], res["duplicate_groups"]) == (14, 14 * 8, 0)
    assert res["disk_bounded"] and res["checkpoint_mb"] > 0, res
    rows = read_jsonl(out / "soak.jsonl")
    assert {r["segment"] for r in rows} == {0, 1}
    assert any(r["servers_procs"] >= 1 and r["verifiers_procs"] >= 1 for r in rows)
    assert all(r["orchestrator_rss_mb"] > 0 for r in rows if r["orchestrator_procs"])
    assert (out / "soak.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.fault("crash")
def test_bad_arguments_are_one_line_errors():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", "soak", "--model", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--model and --train go together" in proc.stderr
    assert "Traceback" not in proc.stderr


def _rows(steps: int, *, fds=lambda s, j: 120 + j, rss=lambda s: 500.0) -> list[dict]:
    """Synthetic samples of one segment: every class with threads and descriptors that jitter by
    -2..+2 around a plateau (``j``), unless ``fds`` says otherwise."""
    out = []
    for s in range(0, steps, 5):
        j = (s * 7919) % 5 - 2  # deterministic jitter in -2..2
        row = {
            "segment": 0,
            "step": s,
            "t": float(s),
            "servers_procs": 2,
            "disk_ckpt_mb": 0.0,
            "disk_other_mb": 0.0,
        }
        for c in ("orchestrator", "servers", "verifiers"):
            row |= {f"{c}_rss_mb": rss(s), f"{c}_fds": fds(s, j), f"{c}_threads": 80 + j, f"{c}_procs": 1}
        out.append(row)
    return out


@pytest.mark.parametrize(
    ("kind", "flat"),
    [("jitter", True), ("step_up", True), ("late_step", True), ("fd_leak", False), ("rss_creep", False)],
)
def test_the_flat_verdict_ignores_jitter_and_catches_a_leak(tmp_path, kind, flat):
    """Counts that come and go by one or two around a plateau are flat, and so is a count that
    settles higher once; a descriptor leaked every 50 steps, or RSS that grows 10% over the
    segment, is not."""
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_soak

    rows = {
        "jitter": lambda: _rows(2000),
        "step_up": lambda: _rows(2000, fds=lambda s, j: 120 + j + 3 * (s > 1000)),  # a pool settles higher
        "late_step": lambda: _rows(2000, fds=lambda s, j: 120 + j + 3 * (s > 1600)),
        "fd_leak": lambda: _rows(2000, fds=lambda s, j: 120 + j + s // 50),
        "rss_creep": lambda: _rows(2000, rss=lambda s: 500.0 * (1 + 0.1 * s / 2000)),
    }[kind]()
    args = bench_soak.parse_args(["--steps", "3000", "--warmup-steps", "100"])
    res = bench_soak.judge(rows, [], tmp_path, args)
    assert res["flat"] is flat, res["segments"]
