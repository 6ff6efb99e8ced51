"""The control plane as the fleet grows: one orchestrator process against 4, 16, 64 servers.

    megatron-rl bench scale [--servers 4,16,64] [--slots 256] [--steps 3] [--group-requests on|off]

At the paper's sizes one orchestrator process (rank 0 of the trainer) issues every request,
receives every completion, hands each to the verifier pool and assembles the batches. How large
a fleet it keeps busy is its CPU per completion against the fleet's completion rate. This program
runs the asynchronous loop of ``megatron-rl bench async`` (the real ``Orchestrator``,
``Rollouts``, ``FleetClient`` over HTTP, ``VerifierPool`` and ``serve-engine`` processes in
``--timing-model`` mode: cheap sleepers with a given cost model; the trainer sleeps) at each
fleet size, with ``n_async`` = servers x slots (every slot filled) and ``n_batch`` = n_async / 2,
as the paper, and reports per size:

- ``completions_per_s``: what the fleet returned over the wall time;
- ``cpu_ms_per_completion``, ``cpu_us_per_token``: the orchestrator process's CPU (every thread;
  not the verifier workers or the servers) per completion and per generated token;
- ``client_busy``: that CPU over the wall (one Python process saturates near 1.0);
- ``async_efficiency``: the ideal schedule's wall (``tools/async_model.py``, zero overhead) over
  the measured one; ``generator_busy``: the servers' own step time over the wall;
- ``update_ms_mean`` / ``update_ms_max``: a weight update's control latency (pause every server
  in place, set the version on every server, hold ``--sync-ms``, resume every server: SGLang's
  update, ``--pause-mode in_place``, the default here; ``none`` times the built-in engine's, which
  does not pause);
- ``rss_kb_per_in_flight``: the orchestrator's resident memory growth over the run per sequence
  in flight;
- ``lost``, ``timed_out``: requests lost with a server or past their timeout (must be 0).

**What one orchestrator sustains.** From the largest fleet's per-token CPU (the conservative
reading: all of it scaled with tokens), one orchestrator at 95% of a core handles
``0.95 / cpu_per_token`` generated tokens per second; a fleet of servers each decoding
``--server-tokens-per-s`` (an assumption: an SGLang server's decode throughput at full batch on
the model and GPU you run; the default 20,000 is of the order of a 24B model on one 8-GPU node)
keeps it at that load with ``max_servers_95`` servers, whatever the completion length. Counted
all per completion instead, ``max_servers_95_per_completion`` is the fleet at ``--trace-tokens``
long completions (another assumption; the paper's traces run to tens of thousands). The truth
lies between; the figures move with the assumptions, and the bench prints them.

The costs are given, not calibrated (defaults: a 60 ms engine step + 0.02 ms per sequence, a
500 ms trainer step + 0.002 ms per token, ``--train-share`` sizing as ``bench async``): the
servers are slowed so that 64 x 256 of them fit this machine's 2 cores next to the
orchestrator; a faster model only moves the completion rate, which the figures are per.

Time: ~2 min per fleet size here (64 servers: starting them takes most of it).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import async_harness
import bench_async
from async_model import Costs, size_fleet

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, int_list_arg, run_cli


def _rss_kb() -> int:
    """This process's resident set size (kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def measure(servers: int, args: argparse.Namespace, root: Path) -> dict:
    """One fleet size: the async loop's figures and its ideal."""
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.rewards.pool import VerifierPool

    n_async = servers * args.slots
    argv = [
        "--servers", str(servers), "--slots", str(args.slots), "--steps", str(args.steps),
        "--group-size", str(args.group_size), "--n-batch", str(n_async // 2), "--n-async", str(n_async),
        "--decode-ms", str(args.decode_ms), "--decode-ms-per-seq", str(args.decode_ms_per_seq),
        "--prefill-ms-per-token", str(args.prefill_ms_per_token), "--train-ms", str(args.train_ms),
        "--train-ms-per-token", str(args.train_ms_per_token), "--median-len", str(args.median_len),
        "--l-max", str(args.l_max), "--sync-ms", str(args.sync_ms), "--workers", str(args.workers),
        "--seed", str(args.seed),
    ]  # fmt: skip
    argv += ["--group-requests", args.group_requests, "--pause-mode", args.pause_mode]
    a = bench_async.parse_args(argv)
    here = root / f"fleet-{servers}"
    here.mkdir(parents=True, exist_ok=True)
    w = async_harness.build_workload(here, a)
    costs = Costs(
        decode_s=a.decode_ms / 1e3,
        decode_s_per_seq=a.decode_ms_per_seq / 1e3,
        prefill_s_per_token=a.prefill_ms_per_token / 1e3,
        train_s=a.train_ms / 1e3,
        train_s_per_token=a.train_ms_per_token / 1e3,
        given=["decode_s", "decode_s_per_seq", "prefill_s_per_token", "train_s", "train_s_per_token"],
    )
    sizing = size_fleet(costs, w.lengths, list(w.prompts.values()), a)
    timing = async_harness.write_timing(w, costs, here)
    api_key = secrets.token_urlsafe(32)
    t0 = time.monotonic()
    procs = async_harness.start_servers(w.init, here, a, api_key, timing)
    print(f"[scale] {servers} servers up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    fleet = None
    try:
        fleet = FleetClient([p.url for p in procs], api_key=api_key)
        with VerifierPool(a.workers) as pool:
            rss0 = _rss_kb()
            r = async_harness.run_mode("async", w, fleet, pool, a, (costs, sizing), api_key)
            rss1 = _rss_kb()
        lost, timed_out = len(fleet.lost), len(fleet.timed_out)
    finally:
        if fleet is not None:
            fleet.close()
        for p in procs:
            p.stop()
    ideal = async_harness.ideal("async", w, costs, sizing, a)
    tokens = r["generated_tokens_per_s"] * r["wall_s"]
    return {
        "servers": servers,
        "in_flight": n_async,
        "n_batch": n_async // 2,
        "wall_s": round(r["wall_s"], 2),
        "completions_per_s": round(r["completions"] / r["wall_s"], 1),
        "cpu_ms_per_completion": round(1e3 * r["client_cpu_s"] / max(1, r["completions"]), 4),
        "cpu_us_per_token": round(1e6 * r["client_cpu_s"] / max(1.0, tokens), 3),
        "client_busy": round(r["client_busy"], 3),
        "async_efficiency": round(ideal["wall_s"] / r["wall_s"], 3),
        "generator_busy": round(r["generator_busy"], 3),
        "update_ms_mean": round(r["weight_update_ms"], 1),
        "update_ms_max": round(r["weight_update_ms_max"], 1),
        "rss_kb_per_in_flight": round(max(0, rss1 - rss0) / n_async, 2),
        "lost": lost,
        "timed_out": timed_out,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--servers", type=int_list_arg(1), default=[4, 16, 64], help="fleet sizes to sweep (comma-separated)"
    )
    ap.add_argument("--slots", type=int_arg(1), default=256, help="sequences per server")
    ap.add_argument("--steps", type=int_arg(1), default=3, help="optimizer steps per fleet size")
    ap.add_argument("--group-size", type=int_arg(1), default=16, help="G")
    async_harness.add_group_requests_arg(ap)
    async_harness.add_pause_mode_arg(ap, "in_place")  # the control calls to every server, timed
    ap.add_argument("--decode-ms", type=float_arg(0.0), default=60.0, help="engine step, fixed part")
    ap.add_argument(
        "--decode-ms-per-seq", type=float_arg(0.0), default=0.02, help="engine step, per sequence"
    )
    ap.add_argument("--prefill-ms-per-token", type=float_arg(0.0), default=0.001)
    ap.add_argument("--train-ms", type=float_arg(0.0), default=500.0)
    ap.add_argument("--train-ms-per-token", type=float_arg(0.0), default=0.002)
    ap.add_argument("--median-len", type=float_arg(0.0, low_open=True), default=64.0)
    ap.add_argument("--l-max", type=int_arg(1), default=512)
    ap.add_argument("--sync-ms", type=float_arg(0.0), default=10.0, help="modeled weight transfer")
    ap.add_argument("--workers", type=int_arg(1), default=1, help="verifier processes")
    ap.add_argument(
        "--server-tokens-per-s",
        type=float_arg(0.0, low_open=True),
        default=20000.0,
        help="assumption: one server's decode tokens/s at full batch, for max_servers_95",
    )
    ap.add_argument(
        "--trace-tokens",
        type=float_arg(0.0, low_open=True),
        default=10000.0,
        help="assumption: mean completion length at paper scale, for max_servers_95_per_completion",
    )
    ap.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed afterwards)")
    args = ap.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = [measure(s, args, root) for s in args.servers]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    cols = list(rows[0])
    print(" ".join(f"{c:>22}" if i else f"{c:>8}" for i, c in enumerate(cols)))
    for r in rows:
        print(" ".join(f"{r[c]!s:>22}" if i else f"{r[c]!s:>8}" for i, c in enumerate(cols)))
    big = rows[-1]
    tokens_per_s = 0.95 / max(1e-12, big["cpu_us_per_token"] / 1e6)
    max_servers = int(tokens_per_s // args.server_tokens_per_s)
    print(
        f"one orchestrator at 95% of a core: {tokens_per_s:,.0f} generated tokens/s (the "
        f"{big['servers']}-server run's {big['cpu_us_per_token']} us of CPU per token, all counted "
        f"per token); at {args.server_tokens_per_s:,.0f} tokens/s per server (an assumption) that is "
        f"{max_servers} servers"
    )
    completions_per_s = 0.95 / max(1e-12, big["cpu_ms_per_completion"] / 1e3)
    max_servers_c = int(completions_per_s * args.trace_tokens // args.server_tokens_per_s)
    print(
        f"counted per completion instead ({big['cpu_ms_per_completion']} ms each): "
        f"{completions_per_s:,.0f} completions/s, at {args.trace_tokens:,.0f}-token traces (an "
        f"assumption) {max_servers_c} servers; the truth lies between the two readings"
    )
    out = {
        "rows": rows,
        "max_servers_95": max_servers,
        "max_servers_95_per_completion": max_servers_c,
        "trace_tokens_assumed": args.trace_tokens,
        "orchestrator_tokens_per_s_95": round(tokens_per_s),
        "server_tokens_per_s_assumed": args.server_tokens_per_s,
        "group_requests": args.group_requests != "off",
        "max_update_ms": max(r["update_ms_max"] for r in rows),
        "lost": sum(r["lost"] for r in rows),
        "timed_out": sum(r["timed_out"] for r in rows),
        "decode_ms": args.decode_ms,
        "decode_ms_per_seq": args.decode_ms_per_seq,
        "slots": args.slots,
        "group_size": args.group_size,
        "steps": args.steps,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench scale", main))
