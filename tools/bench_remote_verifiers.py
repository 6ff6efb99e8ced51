"""What scoring costs the orchestrator's own CPU: the local verifier pool against verifier servers.

    megatron-rl bench remote-verifiers [--tasks 2000] [--group 16] [--kb 40] [--workers 2]

At cluster scale the orchestrator is one process feeding every verifier core; what it spends per
scored sample says how many verifier cores one orchestrator core can keep busy. Two sides, both
started and warm before timing, on the same tasks: (a) the local
:class:`~megatron_rl.rewards.pool.VerifierPool` with ``--workers`` processes (the baseline: tasks
pickled down pipes to this machine's workers) and (b)
:class:`~megatron_rl.rewards.remote.VerifierFleet` sending every ``score`` task to a
``megatron-rl verifier-server`` in another process (``--server-workers``; ``local_share=False``, so
the local workers only stand by), over HTTP on 127.0.0.1 as JSON. The tasks are math samples of
``--kb`` KiB (a ~10k-token trace is ~40 KiB), submitted ``--group`` at a time with
``submit_many``, as the loop does with a group's samples, from this thread; the side waits for
every answer. Measured: this process's CPU seconds (``time.process_time()``: every thread of it,
user + system; the verifier processes are others) over the tasks, so ``client_ms_per_task``.

``verifier_ms_per_task`` is what scoring one of these samples costs a verifier core (the same
``score`` in one process, timed here), and ``cores_fed_per_client_core`` their ratio: the verifier
cores one orchestrator core can feed on this math workload; ``code_cores_fed_per_client_core``
does the same for a code sample costing ``--code-core-s`` core-seconds (the payload cost taken
as this one's; a code sample also carries its tests). The last line is one JSON object of the
figures.
"""

from __future__ import annotations

import json
import random
import select
import subprocess
import sys
import time
from concurrent.futures import wait
from pathlib import Path

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, run_cli
from megatron_rl.rewards.compose import RewardConfig, RewardInput, hard_timeout_s, score
from megatron_rl.rewards.math import warm_up
from megatron_rl.rewards.pool import VerifierPool
from megatron_rl.rewards.remote import VerifierFleet

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "we consider the sum of both numbers and check every case carefully before we conclude that "
    "the value is right so let us write it out again and compare it with the other approach"
).split()


def tasks(n: int, kb: int, seed: int = 0) -> list[RewardInput]:
    """``n`` math samples of about ``kb`` KiB each: a long thinking part, then a boxed answer,
    right or wrong, over 50 problems."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        think = " ".join(rng.choice(WORDS) for _ in range(kb * 1024 // 6))
        ref = i % 50
        answer = ref if rng.random() < 0.5 else rng.randint(0, 99)
        out.append(
            RewardInput(
                problem=f"What is {ref} plus zero? Give the exact value.",
                completion=f"<think>{think}</think>So the answer is $\\boxed{{{answer}}}$.",
                task="math",
                answer=str(ref),
                group_id=f"p{ref}",
                num_tokens=kb * 256,
            )
        )
    return out


def run_side(
    pool: VerifierPool, inputs: list[RewardInput], cfg: RewardConfig, group: int
) -> dict[str, float]:
    """Submit ``inputs`` a group at a time, wait for all; this process's CPU and the wall time."""
    limits = [hard_timeout_s(x, cfg) for x in inputs]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    futures = []
    for i in range(0, len(inputs), group):
        futures += pool.submit_many(
            score, [(x, cfg) for x in inputs[i : i + group]], timeout_s=limits[i : i + group]
        )
    _, pending = wait(futures, timeout=600)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    failed = [f for f in futures if f.done() and f.exception() is not None]
    if pending or failed:
        raise SystemExit(
            f"{len(pending)} tasks unanswered, {len(failed)} failed: {failed[:1] and failed[0].exception()}"
        )
    return {"cpu_s": cpu, "wall_s": wall}


def start_server(workers: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl", "verifier-server", "--workers", str(workers), "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready and proc.stdout else ""
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"the verifier server did not start: {line!r}")
    return proc, line.split()[2]


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int_arg(1), default=2000, help="math samples scored per side")
    ap.add_argument("--group", type=int_arg(1), default=16, help="samples per submit_many (a group)")
    ap.add_argument(
        "--kb", type=int_arg(1), default=40, help="size of each completion in KiB (~10k tokens: 40)"
    )
    ap.add_argument("--workers", type=int_arg(1), default=2, help="local verifier processes")
    ap.add_argument("--server-workers", type=int_arg(1), default=2, help="the server's verifier processes")
    ap.add_argument(
        "--code-core-s",
        type=float_arg(0.0, low_open=True),
        default=1.0,
        help="core-seconds of one code sample",
    )
    args = ap.parse_args(argv)

    cfg = RewardConfig()
    inputs = tasks(args.tasks, args.kb)
    warm = tasks(64, args.kb, seed=1)
    print(
        f"{args.tasks} math samples of {args.kb} KiB, {args.group} per submit ...",
        file=sys.stderr,
        flush=True,
    )
    proc, url = start_server(args.server_workers)
    try:
        with (
            VerifierPool(args.workers) as local,
            VerifierFleet([url], args.workers, local_share=False) as fleet,
        ):
            if not (local.wait_ready(120) and fleet.wait_ready(120)):
                raise SystemExit(f"a pool did not start: {fleet.servers()}")
            sides = {"local": local, "remote": fleet}
            for pool in sides.values():
                run_side(pool, warm, cfg, args.group)
            got = {name: run_side(pool, inputs, cfg, args.group) for name, pool in sides.items()}
            sent = fleet.remote_stats["answered"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if sent < args.tasks + len(warm):
        raise SystemExit(f"only {sent} tasks went to the server")
    warm_up()
    for x in warm:
        score(x, cfg)
    sample = inputs[:200]
    t0 = time.process_time()
    for x in sample:
        score(x, cfg)
    verifier_ms = (time.process_time() - t0) / len(sample) * 1e3

    ms = {name: g["cpu_s"] / args.tasks * 1e3 for name, g in got.items()}
    print(f"{args.tasks} math samples of {args.kb} KiB, {args.group} per submit_many; both sides warm")
    print(f"{'side':44} {'client CPU ms/task':>19} {'ratio':>6} {'wall s':>7} {'tasks/s':>8}")
    rows = [
        (f"local VerifierPool, {args.workers} workers (baseline)", "local"),
        (f"VerifierFleet -> 1 server, {args.server_workers} workers, all remote", "remote"),
    ]
    for what, name in rows:
        wall = got[name]["wall_s"]
        print(
            f"{what:44} {ms[name]:19.3f} {ms[name] / ms['local']:5.2f}x {wall:7.2f} {args.tasks / wall:8.1f}"
        )
    fed = verifier_ms / ms["remote"]
    code_fed = args.code_core_s * 1e3 / ms["remote"]
    print(
        f"scoring one sample costs a verifier core {verifier_ms:.2f} ms: one orchestrator core feeds "
        f"~{fed:.0f} verifier cores on this math workload, ~{code_fed:.0f} on code at {args.code_core_s:g} core-s a sample"
    )
    out = {
        "client_ms_per_task_local": round(ms["local"], 4),
        "client_ms_per_task_remote": round(ms["remote"], 4),
        "remote_over_local_cpu": round(ms["remote"] / ms["local"], 3),
        "verifier_ms_per_task": round(verifier_ms, 3),
        "cores_fed_per_client_core": round(fed, 1),
        "code_cores_fed_per_client_core": round(code_fed, 1),
        "wall_s_local": round(got["local"]["wall_s"], 2),
        "wall_s_remote": round(got["remote"]["wall_s"], 2),
        "tasks": args.tasks,
        "group": args.group,
        "kb": args.kb,
        "workers": args.workers,
        "server_workers": args.server_workers,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench remote-verifiers", main))
