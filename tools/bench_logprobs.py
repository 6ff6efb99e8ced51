"""Peak memory of our log-prob + entropy against the two baselines a user would pick, same inputs.

    megatron-rl bench logprobs [--tokens 8192] [--vocab 131072] [--dtype bfloat16] [--backward]

Baselines: the naive ``log_softmax(logits.float())`` (what a first implementation writes), and
the chunked fp32 log-softmax that verl uses (``verl.utils.torch_functional``: rows taken
``VERL_CHUNK`` = 2048 tokens at a time, cast to fp32, ``log_softmax`` + gather, the entropy as
``logsumexp - sum(softmax * logits)`` per chunk): the strong baseline, since it already avoids
the full fp32 copy.

Each variant runs in a fresh child process that first builds the logits (filled chunk by chunk,
so building them leaves no high-water mark), then reports how far its peak resident memory rose
above that (``ru_maxrss``; on CUDA, ``max_memory_allocated``). The naive baseline is
``log_softmax(logits.float())`` with the taken-token gather and the entropy ``-sum(p log p)``.
``--backward`` adds the backward pass of the log-probs (the training case). The last line is one
JSON object: ``peak_memory_ratio`` = our peak / naive peak, ``peak_over_verl_chunked`` = our
peak / the verl-style chunked peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from megatron_rl.algorithms.logprobs import default_chunk_size, naive_token_logprobs, token_logprobs
from megatron_rl.errors import ArgumentParser, int_arg, run_cli


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


VERL_CHUNK = 2048  # tokens per chunk in verl's chunked log-softmax and entropy


def verl_chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verl-style baseline: per chunk of rows, fp32 log_softmax + gather and the entropy."""
    logps, ents = [], []
    for lo in range(0, logits.shape[0], VERL_CHUNK):
        chunk = logits[lo : lo + VERL_CHUNK].float()
        logps.append(torch.log_softmax(chunk, dim=-1).gather(-1, targets[lo : lo + VERL_CHUNK, None])[:, 0])
        with torch.no_grad():
            ents.append(torch.logsumexp(chunk, -1) - (torch.softmax(chunk, -1) * chunk).sum(-1))
    return torch.cat(logps), torch.cat(ents)


def _child(args) -> None:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    logits = torch.empty(args.tokens, args.vocab, dtype=dtype, device=device)
    for lo in range(0, args.tokens, 256):  # chunked fill: no full-size fp32 temporary
        logits[lo : lo + 256].normal_(0, 3)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)
    logits.requires_grad_(args.backward)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
        hwm_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if args.child == "naive":
        logp, ent = naive_token_logprobs(logits, targets)
    elif args.child == "verl":
        logp, ent = verl_chunked_logprobs(logits, targets)
    else:
        logp, ent = token_logprobs(logits, targets)
    if args.backward:
        logp.sum().backward()
    checksum = float(logp.detach().double().sum()) + float(ent.double().sum())
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # A high-water mark left by the set-up would hide the measured one; the fill above is
        # chunked so this does not happen, but say so if it ever does.
        if hwm <= hwm_before:
            print("warning: peak not above set-up high-water mark", file=sys.stderr)
        peak = hwm - base
    print(json.dumps({"peak_bytes": peak, "seconds": seconds, "checksum": checksum}))


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int_arg(1), default=8192)
    ap.add_argument("--vocab", type=int_arg(1), default=131072)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backward", action="store_true", help="include the backward pass")
    ap.add_argument("--child", choices=["naive", "verl", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return {}

    results = {}
    for variant in ("chunked", "verl", "naive"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--dtype",
            args.dtype,
            "--device",
            args.device,
        ]
        cmd += ["--backward"] if args.backward else []
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{variant} variant failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    c, v, n = results["chunked"], results["verl"], results["naive"]
    gib = 1024**3
    input_gib = (
        args.tokens * args.vocab * torch.empty((), dtype=getattr(torch, args.dtype)).element_size() / gib
    )
    print(
        f"logits {args.tokens} tokens x {args.vocab} vocab, {args.dtype} ({input_gib:.2f} GiB) on "
        f"{args.device}, {'forward + backward' if args.backward else 'forward'}; "
        f"chunk {default_chunk_size(args.vocab)} tokens"
    )
    print(f"{'variant':10} {'peak above inputs':>18} {'seconds':>8}")
    for name, r in (("naive", n), ("verl", v), ("chunked", c)):
        print(f"{name:10} {r['peak_bytes'] / gib:14.3f} GiB {r['seconds']:8.2f}")
    agree = abs(c["checksum"] - n["checksum"]) / max(1.0, abs(n["checksum"]))
    ratio = c["peak_bytes"] / n["peak_bytes"]
    print(
        f"chunked peak = {ratio:.4f} x naive peak ({1 / ratio:.1f}x less); time ratio "
        f"{c['seconds'] / n['seconds']:.2f}; relative checksum difference {agree:.1e}"
    )
    print(f"chunked peak = {c['peak_bytes'] / v['peak_bytes']:.4f} x the verl-style chunked peak")
    out = {
        "peak_memory_ratio": round(ratio, 5),
        "peak_over_verl_chunked": round(c["peak_bytes"] / v["peak_bytes"], 4),
        "verl_chunked_peak_gib": round(v["peak_bytes"] / gib, 4),
        "chunked_peak_gib": round(c["peak_bytes"] / gib, 4),
        "naive_peak_gib": round(n["peak_bytes"] / gib, 4),
        "time_ratio": round(c["seconds"] / n["seconds"], 3),
        "tokens": args.tokens,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "backward": args.backward,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench logprobs", main))
