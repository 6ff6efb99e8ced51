"""Microbatch collation benchmark: greedy first-fit decreasing vs uniform (arrival-order) filling.

    megatron-rl bench collation [--sequences 4096] [--budget 32768] [--batches 5] [--seed 0]

Lengths follow a long-tailed distribution like the paper's: many short answers, a tail reaching
the 32k context (log-normal completions around 1.5k tokens plus 64-512 prompt tokens, clipped to
32,768). For each layout (packed rows with cu_seqlens; padded rows) it prints microbatches used,
the lower bound ceil(total tokens / budget), and padding when every microbatch is a fixed
``budget``-token buffer, for both strategies, averaged over ``--batches`` random minibatches.

The baseline a user would otherwise pick is what ``transformers``/TRL training loops do: a fixed
number of sequences per micro-batch, in arrival order, each padded to the longest in its
micro-batch. It is given the same number of micro-batches as our packed plan (so the same
number of optimizer-loop iterations); ``compute_over_padded_baseline`` is the tokens our packed
plan computes (real tokens only: packed rows carry no padding) over the tokens that baseline
computes (real + padding), and ``padded_baseline_padding`` is that baseline's padding share.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from megatron_rl.batching.collate import collation_stats, plan_microbatches
from megatron_rl.errors import ArgumentParser, int_arg, run_cli


def long_tailed_lengths(n: int, max_len: int, generator: torch.Generator) -> list[int]:
    prompt = torch.randint(64, 513, (n,), generator=generator)
    completion = torch.exp(torch.randn(n, generator=generator) * 1.1 + 7.3)  # median e^7.3 ~ 1.5k
    total = (prompt + completion.round().long().clamp(min=16)).clamp(max=max_len)
    return total.tolist()


def padded_baseline_tokens(lengths: list[int], microbatches: int) -> int:
    """Tokens computed by fixed-size micro-batches (``microbatches`` of them, arrival order),
    each padded to its longest sequence: the plain HF/TRL collation."""
    per = -(-len(lengths) // microbatches)
    return sum(len(c) * max(c) for c in (lengths[i : i + per] for i in range(0, len(lengths), per)))


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int_arg(1), default=4096, help="sequences per minibatch")
    ap.add_argument("--budget", type=int_arg(1), default=32768, help="tokens per microbatch")
    ap.add_argument("--max-len", type=int_arg(1), default=32768, help="longest sequence")
    ap.add_argument("--batches", type=int_arg(1), default=5, help="random minibatches to average over")
    ap.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    args = ap.parse_args(argv)
    if args.budget < args.max_len:  # a microbatch holds at least the longest sequence
        ap.error(
            f"--budget {args.budget} is below --max-len {args.max_len}: raise --budget or lower --max-len"
        )

    gen = torch.Generator().manual_seed(args.seed)
    batches = [long_tailed_lengths(args.sequences, args.max_len, gen) for _ in range(args.batches)]
    rows, figures = [], {}
    for layout in ("packed", "padded"):
        for strategy in ("greedy", "uniform"):
            acc = {"microbatches": 0.0, "lower_bound": 0.0, "padding": 0.0, "shape_padding": 0.0, "ms": 0.0}
            for lengths in batches:
                t0 = time.perf_counter()
                bins = plan_microbatches(lengths, args.budget, layout=layout, strategy=strategy)
                acc["ms"] += (time.perf_counter() - t0) * 1e3
                st = collation_stats(lengths, bins, args.budget, layout)
                acc["microbatches"] += st.microbatches
                acc["lower_bound"] += st.lower_bound
                acc["padding"] += st.padding_fraction
                acc["shape_padding"] += st.shape_padding_fraction
            acc = {k: v / len(batches) for k, v in acc.items()}
            acc["over_lb"] = acc["microbatches"] / acc["lower_bound"]
            figures[(layout, strategy)] = acc
            rows.append((layout, strategy, acc))

    lengths = [n for b in batches for n in b]
    print(
        f"{args.batches} minibatches x {args.sequences} sequences, budget {args.budget} tokens; "
        f"lengths: median {sorted(lengths)[len(lengths) // 2]}, mean {sum(lengths) / len(lengths):.0f}, "
        f"max {max(lengths)}, share >= 16k: {sum(n >= 16384 for n in lengths) / len(lengths):.1%}"
    )
    print(
        f"{'layout':8} {'strategy':9} {'microbatches':>12} {'lower bound':>11} {'÷ bound':>8} "
        f"{'padding':>8} {'shape pad':>9} {'plan ms':>8}"
    )
    for layout, strategy, a in rows:
        print(
            f"{layout:8} {strategy:9} {a['microbatches']:12.1f} {a['lower_bound']:11.1f} {a['over_lb']:8.3f} "
            f"{a['padding']:8.1%} {a['shape_padding']:9.1%} {a['ms']:8.1f}"
        )
    ours = baseline = 0
    for lengths in batches:
        n_mb = len(plan_microbatches(lengths, args.budget, layout="packed", strategy="greedy"))
        ours += sum(lengths)
        baseline += padded_baseline_tokens(lengths, n_mb)
    print(
        f"padded baseline (HF/TRL: fixed micro-batch size, arrival order, pad to the longest, same "
        f"micro-batch count): computes {baseline / ours:.2f}x the real tokens; packed computes 1.00x"
    )
    out = {
        "compute_over_padded_baseline": round(ours / baseline, 4),
        "padded_baseline_padding": round(1 - ours / baseline, 4),
    }
    for layout in ("packed", "padded"):
        g, u = figures[(layout, "greedy")], figures[(layout, "uniform")]
        reduction = (u["padding"] - g["padding"]) / u["padding"] if u["padding"] else 0.0
        suffix = "" if layout == "packed" else "_padded"
        out[f"microbatches_over_lower_bound{suffix}"] = round(g["over_lb"], 4)
        out[f"uniform_microbatches_over_lower_bound{suffix}"] = round(u["over_lb"], 4)
        out[f"padding_greedy{suffix}"] = round(g["padding"], 4)
        out[f"padding_uniform{suffix}"] = round(u["padding"], 4)
        out[f"padding_reduction_vs_uniform{suffix}"] = round(reduction, 4)
        print(
            f"{layout}: greedy uses {g['over_lb']:.3f}x the lower bound of microbatches "
            f"(uniform {u['over_lb']:.3f}x) and has {reduction:.1%} less padding than uniform"
        )
    out.update(sequences=args.sequences, budget=args.budget, batches=args.batches)
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench collation", main))
