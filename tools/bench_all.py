"""Every benchmark, one after another, into one table: ``benchmarks/results.json`` and
``benchmarks/RESULTS.md`` (machine, command, figure, value, baseline, goal), and with
``--docs`` the table of docs/performance.md between its ``bench:begin``/``bench:end`` markers.

    megatron-rl bench all [--only generation,verifiers] [--out benchmarks] [--docs]

Each benchmark runs in a process of its own (nothing warm carries over from one to the next) with
the arguments listed in ``BENCHES``, and prints its last-line JSON; this program keeps that line
whole in ``results.json`` and puts the figures of ``FIGURES`` in the table, each with what it
means, the baseline it is measured against and the goal it is held to. A benchmark that fails
is recorded with its exit status and the tail of its output; the others still run. Progress: one
line per benchmark as it starts and ends. On 2 shared cores the whole set takes about 7 minutes
(the sum of the ``wall_s`` that ``results.json`` keeps per benchmark).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from doc_tables import write_table

from megatron_rl.errors import ArgumentParser, float_arg, run_cli

ROOT = Path(__file__).resolve().parents[1]

# name -> the bench and its extra arguments (each bench's defaults unless listed; the set takes
# about 7 min on 2 shared cores). The name is the bench's unless one bench runs twice ("async-real").
BENCHES: dict[str, list[str]] = {
    "generation": ["generation"],
    "train-step": ["train-step"],
    "verifiers": ["verifiers"],
    "weight-sync": ["weight-sync"],
    "async": ["async"],
    "async-real": ["async", "--real"],
    "collation": ["collation"],
    "logprobs": ["logprobs"],
    "convert": ["convert", "--small"],
    "pause-latency": ["pause-latency"],
}


@dataclass(frozen=True)
class Figure:
    bench: str
    key: str
    meaning: str
    baseline: str
    goal: str = ""  # ">= 2.0", "<= 1.15", or "" (reported, no goal)

    def met(self, value: object) -> str:
        m = re.fullmatch(r"(>=|<=) ([0-9.]+)", self.goal)
        if m is None or not isinstance(value, (int, float)):
            return ""
        ok = value >= float(m[2]) if m[1] == ">=" else value <= float(m[2])
        return "yes" if ok else "**no**"


FIGURES = [
    Figure(
        "generation",
        "engine_over_hf_generate",
        "built-in engine tokens/s over transformers generate, RL workload (groups sharing a "
        "prompt, EOS-terminated long-tailed lengths, continuous arrivals)",
        "`transformers` `generate`, same model, prompts and sampling, at its best batch size",
        ">= 2.0",
    ),
    Figure(
        "train-step",
        "trainer_over_plain_torch",
        "Megatron trainer tokens/s over a plain PyTorch step, same model, batches, threads (fp32)",
        "a plain PyTorch/HF forward + GRPO loss + backward + AdamW step",
        ">= 1.0",
    ),
    Figure(
        "verifiers",
        "math_pool_speedup",
        "math verifications/s through the 2-worker pool (verdict cache off) over one warm process",
        "math-verify parse + verify in a loop, in one warm process",
        ">= 1.7",
    ),
    Figure(
        "verifiers",
        "math_verdict_cache_speedup",
        "math verifications/s with the verdict cache (one batch's repeated answers) over one warm process",
        "math-verify parse + verify in a loop, in one warm process",
    ),
    Figure(
        "verifiers",
        "cpp_pch_compile_ratio",
        "C++ compile time with the precompiled bits/stdc++.h over without",
        "g++ without the precompiled header",
        "<= 0.5",
    ),
    Figure(
        "weight-sync",
        "broadcast_over_raw",
        "a full weight update (pack, broadcast, apply, control) over one raw broadcast of its bytes",
        "one flat uint8 broadcast of the same bytes over the same group",
        "<= 1.15",
    ),
    Figure(
        "async",
        "async_speedup",
        "sync-loop wall time over async-loop wall time, same workload (timing model, calibrated)",
        "the same loop in sync mode",
        ">= 3.0",
    ),
    Figure(
        "async",
        "async_efficiency",
        "measured async speedup over the cost model's ideal",
        "the ideal",
        ">= 0.9",
    ),
    Figure(
        "async",
        "generator_busy_async",
        "fraction of wall time the generators decode (async)",
        "1.0",
        ">= 0.95",
    ),
    Figure(
        "async-real",
        "async_speedup_real",
        "async speedup with the real tiny model, engine and trainer (2 shared cores: noisy)",
        "the same loop in sync mode",
    ),
    Figure(
        "collation",
        "compute_over_padded_baseline",
        "tokens our packed micro-batches compute over those of padded fixed-size micro-batches",
        "HF/TRL collation: fixed sequences per micro-batch, padded to the longest",
    ),
    Figure(
        "collation",
        "microbatches_over_lower_bound",
        "microbatches used over the token-budget lower bound",
        "ceil(tokens / budget)",
    ),
    Figure(
        "logprobs",
        "peak_memory_ratio",
        "peak memory of our log-probs + entropy over a naive log-softmax",
        "naive fp32 log_softmax",
    ),
    Figure(
        "logprobs",
        "peak_over_verl_chunked",
        "peak memory of our log-probs + entropy over verl's chunked fp32 log-softmax",
        "verl-style 2,048-token chunks",
    ),
    Figure(
        "convert",
        "ratio_to_durable_copy",
        "convert GB/s (both directions) over a durable safetensors copy's",
        "load + save + fsync",
    ),
    Figure(
        "pause-latency",
        "plain_over_fair",
        "engine steps before a pause lands, plain lock over ours",
        "plain lock",
    ),
]


def _machine() -> dict[str, object]:
    import torch  # lazy: only the machine description needs it

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _run(bench: list[str], timeout_s: float) -> dict[str, object]:
    """Run ``megatron-rl bench BENCH ARGS...`` and keep its last-line JSON (or why there is none)."""
    cmd = [sys.executable, "-m", "megatron_rl", "bench", *bench]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, out = proc.returncode, proc.stdout + proc.stderr
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    except subprocess.TimeoutExpired as e:
        rc, lines = 124, []
        out = f"timed out after {timeout_s:.0f} s\n" + (e.stdout or b"").decode(errors="replace")[-2000:]
    result: dict[str, object] = {
        "command": "megatron-rl bench " + " ".join(bench),
        "exit_status": rc,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    try:
        result["result"] = json.loads(lines[-1]) if rc == 0 and lines else None
    except ValueError:
        result["result"] = None
    if result["result"] is None:
        result["output_tail"] = out[-3000:]
    return result


def _table(results: dict[str, dict[str, object]], machine: dict[str, object]) -> str:
    rows = [
        f"Measured on {machine['cpu']} ({machine['cores']} cores"
        + (f", {machine['gpu']}" if machine["gpu"] else ", no GPU")
        + f"), Python {machine['python']}, torch {machine['torch']}, {machine['date']}; "
        "regenerate with `megatron-rl bench all --docs`.",
        "",
        "| figure | value | goal | met | what it is | baseline | command |",
        "|---|---:|---|---|---|---|---|",
    ]
    for f in FIGURES:
        r = results.get(f.bench)
        if r is None:
            continue
        data = r.get("result")
        value = data.get(f.key) if isinstance(data, dict) else None
        shown = (
            "failed"
            if data is None
            else ("—" if value is None else f"{value:g}" if isinstance(value, float) else value)
        )
        rows.append(
            f"| `{f.key}` | {shown} | {f.goal or '—'} | {f.met(value)} | {f.meaning} | {f.baseline} "
            f"| `{r['command']}` |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--only",
        default="",
        help="comma-separated benchmarks (default: all); the others keep their last results",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks", help="results folder")
    p.add_argument(
        "--docs", action="store_true", help="rewrite docs/performance.md's table between its markers"
    )
    p.add_argument("--timeout-s", type=float_arg(0.0, low_open=True), default=900.0, help="per benchmark")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"bench all: unknown benchmark(s) {unknown}; known: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    machine = _machine()
    results: dict[str, dict[str, object]] = {}
    previous = args.out / "results.json"
    if args.only and previous.is_file():  # a partial run updates the table, keeping the others
        try:
            results.update(json.loads(previous.read_text()).get("benches", {}))
        except (ValueError, AttributeError):
            print(f"bench all: {previous} is not a results file; starting a new one", file=sys.stderr)
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        results[name] = r = _run(BENCHES[name], args.timeout_s)
        status = "ok" if r.get("result") is not None else f"FAILED (exit {r['exit_status']})"
        print(f"[{i}/{len(names)}] {name}: {status} in {r['wall_s']} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"machine": machine, "benches": results}, indent=2) + "\n"
    )
    table = _table(results, machine)
    (args.out / "RESULTS.md").write_text("# Benchmarks\n\n" + table)
    if args.docs:
        try:
            write_table("bench", table)
        except ValueError as e:
            print(f"bench all: {e}", file=sys.stderr)
            return 2
    print(table)
    summary = {
        f"{f.bench}.{f.key}": (results[f.bench].get("result") or {}).get(f.key)
        for f in FIGURES
        if f.bench in results
    }
    print(json.dumps(summary))
    return 0 if all(results[n].get("result") is not None for n in names) else 1


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench all", main))
