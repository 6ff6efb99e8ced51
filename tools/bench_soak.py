"""A days-long run, compressed: does a run stay flat, and does a kill lose anything?

    megatron-rl bench soak [--steps 5000] [--kills 3] [--checkpoint-every 50] [--out DIR]
                           [--model HF_FOLDER --train PROBLEMS.jsonl]

Runs ``megatron-rl train`` (the real loop: async GRPO, the built-in engine server, the verifier
pool, the Megatron trainer, checkpoints rotated to ``run.keep_last``) on the quick start's tiny
policy (its warm-up is run first unless ``--model``/``--train`` are given) with small batches, so
that thousands of optimizer steps take minutes, not days. Every ``--sample-s`` seconds it reads,
from ``/proc`` through psutil, each process of the run:

- the orchestrator (the ``train`` process: trainer rank 0, rollouts, client, pool dispatcher),
- the engine servers, and the verifier workers (their sum),

their resident memory (RSS), open file descriptors and threads, and the run directory's size
(checkpoints apart from the rest: the JSONL logs grow with the steps by design), with the step
the run has reached (``metrics.jsonl``). At ``--kills`` random steps it kills the whole run
(SIGKILL to its process group, as a lost node) and starts it again; it resumes from its latest
checkpoint (``run.resume: auto``).

**Verdicts** (the last-line JSON; the rows are in ``soak.jsonl``, the plot in ``soak.png``):

- ``flat``: in every segment between kills long enough to judge (past its warm-up of
  ``--warmup-steps``), the orchestrator's and the servers' RSS grew less than 5% (the median of
  the segment's last five samples against its first five), and the descriptors and threads of
  no process class kept rising: a leak lifts the fewest of the segment's third fifth above the
  most of its first fifth, and the fewest of its last fifth above the most of its third (they
  come and go by one or two between samples, and a pool may settle one higher once; neither
  reads as rising); the checkpoints' bytes stayed within
  ``keep_last + 1`` checkpoints' worth (one is written before the oldest is removed; one more
  after a kill: the killed run's partial save, swept by the next save);
- ``nothing_lost``: the resumed run trained every step once (steps 1..N in ``metrics.jsonl``),
  ``n_batch`` sequences each, and no group twice (``ledger.jsonl``): what an uninterrupted run
  trains.

The logs' growth is reported as bytes per step (``log_bytes_per_step``), not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

import psutil
import yaml

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, run_cli

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PROMPT = "Think inside <think> </think>, then answer."  # the quick start's warm-up prompt
CLASSES = ("orchestrator", "servers", "verifiers")


def recipe(args: argparse.Namespace, model: str, train: str, run_dir: Path) -> dict:
    """The soak's run: the quick start's recipe, with batches small enough for thousands of steps."""
    return {
        "model": {"hf": model},
        "data": {"train": train, "system_prompt": SYSTEM_PROMPT},
        "loop": {
            "mode": "async",
            "group_size": 4,
            "n_batch": args.n_batch,
            "n_async": 2 * args.n_batch,
            "max_steps": args.steps,
            "seed": args.seed,
            "max_dropped_batches": 0,  # a weak policy's run of dropped groups is not the question here
        },
        "reward": {"l_max": 48, "l_cache": 16, "workers": 1},
        "algorithm": {"eps_high": 0.28},
        "batching": {"layout": "padded", "token_budget": 4096},
        "trainer": {"cpu_threads": 1, "optim": {"lr": 1.0e-5}},
        "fleet": {"local_servers": 1, "max_slots": 2 * args.n_batch, "max_len": 160, "threads": 1},
        "run": {"dir": str(run_dir), "checkpoint_every": args.checkpoint_every, "keep_last": args.keep_last},
    }


def warm_up(out: Path) -> tuple[str, str]:
    """The quick start's tiny SFT policy and its problems (reused when already there)."""
    warm = out / "warmup"
    if not (warm / "warmup.json").exists():
        print(f"[soak] warm-up (tokenizer, tiny model, SFT) in {warm}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "megatron_rl.quickstart.warmup", "--out", str(warm)]
        subprocess.run(cmd, check=True, cwd=ROOT)
    paths = json.loads((warm / "warmup.json").read_text())["paths"]
    return paths["sft"], paths["train"]


def _jsonl(path: Path) -> list[dict]:
    """The records of a log the kills may have cut mid-line (skipped: the run wrote them again)."""
    from megatron_rl.fileio import JsonlError, iter_jsonl

    if not path.exists():
        return []
    return [v for _, v in iter_jsonl(path, skip_bad=True) if not isinstance(v, JsonlError)]


def last_step(run_dir: Path) -> int:
    """The last step in ``metrics.jsonl`` (0 before any), read from its tail only."""
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def _bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed by the rotation while we walked
    return total


def _classify(proc: psutil.Process, top: int) -> str:
    if proc.pid == top:
        return "orchestrator"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "verifiers"
    return "servers" if "serve-engine" in cmd or "engine.server" in cmd else "verifiers"


def sample(top: psutil.Process, run_dir: Path) -> dict:
    """One row: per process class the summed RSS (MB), descriptors and threads; the disk."""
    row: dict = {"t": time.time(), "step": last_step(run_dir)}
    sums = {c: Counter() for c in CLASSES}
    try:
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue  # exited (killed), not yet reaped: nothing of it is resident any more
                c = sums[_classify(p, top.pid)]
                c["rss_mb"] += p.memory_info().rss / 2**20
                c["fds"] += p.num_fds()
                c["threads"] += p.num_threads()
                c["procs"] += 1
        except psutil.Error:
            continue  # ended between the listing and the read
    for c in CLASSES:
        for k in ("rss_mb", "fds", "threads", "procs"):
            row[f"{c}_{k}"] = round(sums[c][k], 1)
    ckpt = _bytes(run_dir / "checkpoints")
    row["disk_ckpt_mb"] = round(ckpt / 2**20, 2)
    row["disk_other_mb"] = round((_bytes(run_dir) - ckpt) / 2**20, 2)
    return row


def run_soak(args: argparse.Namespace, out: Path) -> tuple[list[dict], list[int]]:
    """Run, sample, kill at the chosen steps, resume; the rows and the steps killed at."""
    model, train = (args.model, args.train) if args.model else warm_up(out)
    run_dir = out / "run"
    path = out / "soak.yaml"
    path.write_text(yaml.safe_dump(recipe(args, model, train, run_dir)))
    rng = random.Random(args.seed)
    lo, hi = max(2, int(args.steps * 0.15)), max(3, int(args.steps * 0.85))
    kills = sorted(rng.sample(range(lo, hi), min(args.kills, max(0, hi - lo))))
    rows: list[dict] = []
    killed_at: list[int] = []
    segment = 0
    with (out / "soak.jsonl").open("w") as log, (out / "train.log").open("ab") as train_log:
        while True:
            cmd = [sys.executable, "-m", "megatron_rl", "train", str(path), "--no-progress"]
            proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=train_log, stderr=subprocess.STDOUT, start_new_session=True
            )
            top = psutil.Process(proc.pid)
            target = kills[len(killed_at)] if len(killed_at) < len(kills) else None
            try:
                while proc.poll() is None:
                    row = {**sample(top, run_dir), "segment": segment}
                    rows.append(row)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    print(
                        f"[soak] step {row['step']}/{args.steps}: orchestrator {row['orchestrator_rss_mb']:.0f} MB, "
                        f"{row['orchestrator_fds']:.0f} fds, {row['orchestrator_threads']:.0f} threads; servers "
                        f"{row['servers_rss_mb']:.0f} MB; disk {row['disk_ckpt_mb'] + row['disk_other_mb']:.0f} MB",
                        file=sys.stderr,
                        flush=True,
                    )
                    if target is not None and row["step"] >= target:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        killed_at.append(row["step"])
                        print(f"[soak] killed at step {row['step']}; resuming", file=sys.stderr, flush=True)
                        break
                    time.sleep(args.sample_s)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            if proc.returncode == 0:
                return rows, killed_at
            if proc.returncode != -signal.SIGKILL:
                tail = (out / "train.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"bench soak: the run failed (exit {proc.returncode}):\n{tail}")
            segment += 1


def judge(rows: list[dict], killed_at: list[int], run_dir: Path, args: argparse.Namespace) -> dict:
    """The verdicts of the module docstring, with the figures they rest on."""
    segments = []
    for seg in sorted({r["segment"] for r in rows}):
        # While training: the servers up, the last step not reached (the end exports, evaluates
        # and shuts down, which is not the steady state).
        seg_rows = [r for r in rows if r["segment"] == seg and r["servers_procs"] and r["step"] < args.steps]
        if not seg_rows:
            continue
        start = seg_rows[0]["step"]
        warm = [r for r in seg_rows if r["step"] >= start + args.warmup_steps]
        if len(warm) < 10:
            continue  # too short to judge
        first, last = warm[:5], warm[-5:]
        m = lambda rs, k: median(r[k] for r in rs)
        s = {"segment": seg, "from_step": warm[0]["step"], "to_step": warm[-1]["step"]}
        for c in ("orchestrator", "servers"):
            s[f"{c}_rss_growth"] = round(m(last, f"{c}_rss_mb") / max(1e-9, m(first, f"{c}_rss_mb")) - 1, 4)
        # Descriptors and threads come and go by one or two between samples (a request's
        # connection, a pool's thread started on demand), and a pool may settle one higher
        # once (a kept-alive connection more): neither a median nor a ceiling is steady. A
        # leak keeps lifting the whole count. In fifths of the segment: the fewest of the third
        # fifth is above the most of the first, and the fewest of the fifth above the most of
        # the third (jitter never rises like that; a one-time step, wherever it falls, rises in
        # one of the two at most). The figure: the last fifth's fewest against the first's most.
        f = max(1, len(warm) // 5)
        for c in CLASSES:
            for k in ("fds", "threads"):
                n = [r[f"{c}_{k}"] for r in warm]
                w1, w3, w5 = n[:f], n[2 * f : 3 * f], n[4 * f :]
                s[f"{c}_{k}_growth"] = min(w5) - max(w1)
                s[f"{c}_{k}_rising"] = min(w3) > max(w1) and min(w5) > max(w3)
        s["flat"] = all(s[f"{c}_rss_growth"] < 0.05 for c in ("orchestrator", "servers")) and not any(
            s[f"{c}_{k}_rising"] for c in CLASSES for k in ("fds", "threads")
        )
        segments.append(s)
    ckpts = sorted((run_dir / "checkpoints").glob("*/")) if (run_dir / "checkpoints").is_dir() else []
    one_ckpt_mb = (_bytes(ckpts[-1]) / 2**20) if ckpts else 0.0
    max_ckpt_mb = max(r["disk_ckpt_mb"] for r in rows)
    # keep_last, plus the one being written before the oldest goes; after a kill, plus the killed
    # run's partial save (a leftover the next save sweeps).
    allowed = args.keep_last + 1 + (1 if killed_at else 0)
    disk_bounded = max_ckpt_mb <= allowed * one_ckpt_mb * 1.05 + 1.0
    metrics = _jsonl(run_dir / "metrics.jsonl")
    steps = [int(m["step"]) for m in metrics]
    ledger = _jsonl(run_dir / "ledger.jsonl")
    trained = [(e["prompt_id"], e["epoch"]) for e in ledger if e.get("event") == "trained"]
    sequences = sum(int(m["sequences"]) for m in metrics)
    nothing_lost = (
        steps == list(range(1, args.steps + 1))
        and sequences == args.steps * args.n_batch
        and len(trained) == len(set(trained)) == sum(int(m["groups/trained"]) for m in metrics)
    )
    span = rows[-1]["step"] - rows[0]["step"]
    growth = rows[-1]["disk_other_mb"] - rows[0]["disk_other_mb"]
    return {
        "flat": bool(segments) and all(s["flat"] for s in segments),
        "nothing_lost": nothing_lost,
        "disk_bounded": disk_bounded,
        "segments": segments,
        "killed_at": killed_at,
        "steps": args.steps,
        "trained_steps": len(steps),
        "trained_sequences": sequences,
        "expected_sequences": args.steps * args.n_batch,
        "trained_groups": len(trained),
        "duplicate_groups": len(trained) - len(set(trained)),
        "checkpoint_mb": round(one_ckpt_mb, 2),
        "checkpoints_max_mb": max_ckpt_mb,
        "log_bytes_per_step": round(growth * 2**20 / span) if span else 0,
        "samples": len(rows),
        "wall_s": round(rows[-1]["t"] - rows[0]["t"], 1),
    }


def plot(rows: list[dict], killed_at: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    step = [r["step"] for r in rows]
    panels = [
        ("resident memory (MB)", "rss_mb"),
        ("open file descriptors", "fds"),
        ("threads", "threads"),
    ]
    for ax, (title, key) in zip(axes.flat, panels):
        for c in CLASSES:
            ax.plot(step, [r[f"{c}_{key}"] for r in rows], ".", ms=2, label=c)
        ax.set_title(title)
    ax = axes.flat[3]
    ax.plot(step, [r["disk_ckpt_mb"] for r in rows], ".", ms=2, label="checkpoints")
    ax.plot(step, [r["disk_other_mb"] for r in rows], ".", ms=2, label="logs, exports")
    ax.set_title("run directory (MB)")
    for ax in axes.flat:
        for k in killed_at:
            ax.axvline(k, color="red", lw=0.8, ls="--")
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step (red: killed, resumed)")
    fig.suptitle("bench soak: one run, killed and resumed (tools/bench_soak.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = ArgumentParser(prog="megatron-rl bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int_arg(1), default=5000, help="optimizer steps of the run")
    ap.add_argument("--n-batch", type=int_arg(1), default=8, help="sequences per step (groups of 4)")
    ap.add_argument("--kills", type=int_arg(0), default=3, help="SIGKILLs of the whole run at random steps")
    ap.add_argument("--checkpoint-every", type=int_arg(1), default=50, help="run.checkpoint_every")
    ap.add_argument("--keep-last", type=int_arg(1), default=2, help="run.keep_last")
    ap.add_argument(
        "--sample-s", type=float_arg(0.0, low_open=True), default=5.0, help="seconds between samples"
    )
    ap.add_argument("--warmup-steps", type=int_arg(0), default=100, help="steps of each segment not judged")
    ap.add_argument("--model", help="HF folder of the policy (default: the quick start's warm-up)")
    ap.add_argument("--train", help="problems JSONL (with --model)")
    ap.add_argument("--out", help="work folder (default: a temporary one, kept: it holds the rows and plot)")
    ap.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    args = ap.parse_args(argv)
    if bool(args.model) != bool(args.train):
        ap.error("--model and --train go together")
    if args.steps < 2 or args.n_batch < 4 or args.n_batch % 4:
        ap.error("--steps must be >= 2 and --n-batch a multiple of 4 (>= 4)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="megatron-rl-soak-")).absolute()
    out.mkdir(parents=True, exist_ok=True)
    rows, killed_at = run_soak(args, out)
    result = judge(rows, killed_at, out / "run", args)
    plot(rows, killed_at, out / "soak.png")
    result.update(out=str(out), plot=str(out / "soak.png"), n_batch=args.n_batch,
                  checkpoint_every=args.checkpoint_every, keep_last=args.keep_last)  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench soak", main))
