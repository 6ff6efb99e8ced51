"""Time of one GRPO training step (forward, backward, optimizer) at TP=1 and TP=2, same batch.

    megatron-rl bench train-step [--hidden 128] [--layers 4] [--vocab 4000] [--sequences 16]
                                 [--prompt 32] [--completion 96] [--budget 1024] [--steps 5]

Each layout runs in fresh processes started here with ``torch.multiprocessing`` (gloo on CPU,
NCCL on GPUs): TP=1 on one rank, TP=2 on two (one GPU each; skipped with fewer than two GPUs).
Every rank builds the same tiny Llama-style policy (CPU initialisation does not depend on TP, so
both layouts start from the same weights and the first step's loss and gradient norm must agree)
and runs ``PolicyTrainer.rl_step`` on the same synthetic minibatch: ``--warmup`` untimed steps,
then ``--steps`` timed ones (median reported). ``--threads`` intra-op threads per rank (default 1
on CPU, so TP=2 uses two cores where TP=1 uses one: the ratio shows what splitting buys).

Tokens/s counts prompt + completion tokens of the minibatch. On a GPU, MFU = 6 * params *
tokens/s / (GPUs x peak FLOP/s), the usual dense-transformer estimate (attention's own FLOPs not
counted); ``--peak-flops`` defaults to 989e12, the H100/H200 dense bf16 figure. The last line is
one JSON object: ``tokens_per_s`` (TP=1), ``tp2_over_tp1_step_time``, and ``mfu`` on GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _batch(args):
    """The synthetic minibatch: random prompts, completions and rewards, GRPO-weighted."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    g = torch.Generator().manual_seed(args.seed)
    groups = []
    for gi in range(max(1, args.sequences // args.group_size)):
        prompt = Prompt(
            prompt_id=str(gi), token_ids=torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()
        )
        scored = []
        for k in range(args.group_size):
            n = int(torch.randint(args.completion // 2, args.completion + 1, (1,), generator=g))
            comp = Completion(
                prompt_id=str(gi),
                sample_index=k,
                token_ids=torch.randint(0, args.vocab, (n,), generator=g).tolist(),
                logprobs=[-math.log(args.vocab)] * n,
                versions=[0] * n,
            )
            scored.append(ScoredCompletion(completion=comp, reward=float(k % 2)))
        groups.append(Group(prompt=prompt, completions=scored))
    return build_train_batch(groups, GRPOConfig())


def _trainer(args, tp: int):
    import transformers

    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import OptimConfig, TrainerConfig
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.trainer import PolicyTrainer

    hf = transformers.LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn or 4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=4 * args.budget,
        rms_norm_eps=1e-5,
    )
    cfg = TrainerConfig(
        parallel=ParallelConfig(tensor_parallel=tp), optim=OptimConfig(lr=1e-5), seed=args.seed
    )
    return PolicyTrainer(hf, cfg, GRPOConfig(), BatchingConfig(token_budget=args.budget))


def _worker(rank: int, world: int, init_file: str, args, results) -> None:
    """One rank: build the trainer at TP = ``world``, run the steps, rank 0 reports."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
        os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        trainer = _trainer(args, tp=world)
        batch = _batch(args)
        first = trainer.rl_step(batch)
        for _ in range(args.warmup - 1):
            trainer.rl_step(batch)
        timed = [trainer.rl_step(batch) for _ in range(args.steps)]
        params = trainer.num_parameters()  # collective
        if rank == 0:
            step = statistics.median(m["step_time_s"] for m in timed)
            results.put(
                {
                    "ranks": world,
                    "params": params,
                    "padded_vocab": trainer.chunks[0].vocab_size,
                    "tokens": sum(batch.lengths),
                    "sequences": len(batch),
                    "microbatches": first["microbatches"],
                    "padding": first["padding_fraction"],
                    "loss": first["loss"],
                    "grad_norm": first["grad_norm"],
                    "step_s": step,
                }
            )
        trainer.close()
    finally:
        dist.destroy_process_group()


def _run_layout(args, world: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "init"), args, results),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    return results.get()


def _table(args, rows: dict[int, dict]) -> None:
    base = rows[1]
    print(
        f"GRPO train step: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
        f"(padded {base['padded_vocab']}), {base['params'] / 1e6:.2f}M parameters; "
        f"{base['sequences']} sequences, {base['tokens']} tokens; budget {args.budget} "
        f"(packed, greedy); {args.threads} thread(s) per rank; median of {args.steps} steps"
    )
    print(
        f"{'layout':7} {'ranks':>5} {'microbatches':>12} {'padding':>8} {'step s':>8} "
        f"{'tokens/s':>10} {'loss':>10} {'grad norm':>10} {'÷ TP=1 time':>12}"
    )
    for tp, r in rows.items():
        print(
            f"{'TP=' + str(tp):7} {r['ranks']:5d} {r['microbatches']:12.0f} {r['padding']:8.1%} "
            f"{r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {r['loss']:10.5f} "
            f"{r['grad_norm']:10.5f} {r['step_s'] / base['step_s']:12.3f}"
        )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=0, help="MLP width (0: 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--sequences", type=int, default=16, help="completions per minibatch")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=96, help="longest completion (half to full)")
    ap.add_argument("--budget", type=int, default=1024, help="microbatch token budget")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument(
        "--peak-flops",
        type=float,
        default=989e12,
        help="per-GPU peak FLOP/s for MFU (H100/H200 dense bf16: 989e12)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.warmup = max(1, args.warmup)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    layouts = [1, 2] if gpus != 1 else [1]  # TP=2 on GPUs needs two of them
    rows = {tp: _run_layout(args, tp) for tp in layouts}
    for r in rows.values():
        r["tokens_per_s"] = r["tokens"] / r["step_s"]
    _table(args, rows)
    out = {"tokens_per_s": round(rows[1]["tokens_per_s"], 1), "step_time_s": round(rows[1]["step_s"], 4)}
    if 2 in rows:
        out["tokens_per_s_tp2"] = round(rows[2]["tokens_per_s"], 1)
        out["tp2_over_tp1_step_time"] = round(rows[2]["step_s"] / rows[1]["step_s"], 4)
        # Same weights and batch: the first step's loss and gradient norm agree up to fp32
        # reordering (~1e-6 relative); 1e-4 flags a real difference.
        same = all(
            abs(rows[2][k] - rows[1][k]) <= 1e-4 * max(1.0, abs(rows[1][k])) for k in ("loss", "grad_norm")
        )
        print(
            f"TP=2 / TP=1 step time: {out['tp2_over_tp1_step_time']:.3f} (ideal 0.5); "
            f"first-step loss and grad norm {'match' if same else 'DIFFER'} across layouts"
        )
        out["tp1_tp2_first_step_match"] = same
    if gpus:
        for tp, r in rows.items():
            mfu = 6 * r["params"] * r["tokens_per_s"] / (tp * args.peak_flops)
            out["mfu" if tp == 1 else "mfu_tp2"] = round(mfu, 5)
        print(f"MFU (6 N tokens/s over {args.peak_flops:.3g} FLOP/s per GPU): TP=1 {out['mfu']:.2%}")
    out["params"] = rows[1]["params"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
