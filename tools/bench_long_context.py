"""Peak activation memory per rank and step time of one long sequence, at context parallelism 1, 2
and 4 (``trainer.parallel.context_parallel``), on a tiny model.

    megatron-rl bench long-context [--tokens 16384] [--cp 1,2,4] [--hidden 128] [--layers 2]
                                   [--vocab 4000] [--steps 2]

Each CP size runs in fresh processes started here (gloo on CPU, NCCL on GPUs), ``cp`` ranks of
one data-parallel replica. Every rank builds the same tiny Llama (CPU initialisation: the same
weights at every CP size) and runs ``PolicyTrainer.forward_backward`` (GRPO loss) on one
sequence of ``--tokens`` tokens (a 64-token prompt, the rest completion), packed; at CP > 1 the
trainer splits it into Megatron's zig-zag chunks and the attention all-gathers keys and values
over the group (``training/attention.py``).

**Peak activation memory** is measured exactly, not from the process's resident size: the bytes of
every tensor the forward pass saves for the backward (``torch.autograd.graph.saved_tensors_hooks``;
each storage counted once, the model's parameters and their views excluded), summed at the end of
the forward, where it peaks (one micro-batch: the backward starts only then). Step time is the
median of ``--steps`` forward + backward passes after one warm-up; on a CPU machine the ranks
share its cores (4 ranks on 2 cores here), so it says what the split costs in communication and
recomputation rather than what it buys. The loss of each CP size is printed: the same sequence,
so they agree to ~1e-6.

The last line is one JSON object: ``memory_ratio_cp2`` / ``memory_ratio_cp4`` (per-rank peak
activation memory over CP=1's; 1/2 and 1/4 would be a perfect split), the peaks and step times.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.errors import ArgumentParser, int_arg, int_list_arg, run_cli


def _hf_config(args):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=args.tokens + 64,
        rms_norm_eps=1e-5,
    )


def _batch(args):
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    g = torch.Generator().manual_seed(0)
    prompt = Prompt(prompt_id="p", token_ids=torch.randint(0, args.vocab, (64,), generator=g).tolist())
    n = args.tokens - 64
    scored = [
        ScoredCompletion(
            completion=Completion(
                prompt_id="p",
                sample_index=k,
                token_ids=torch.randint(0, args.vocab, (n if k == 0 else 1,), generator=g).tolist(),
                logprobs=[-math.log(args.vocab)] * (n if k == 0 else 1),
                versions=[0] * (n if k == 0 else 1),
            ),
            reward=float(k),
        )
        for k in range(2)
    ]
    batch = build_train_batch([Group(prompt=prompt, completions=scored)], GRPOConfig())
    batch.sequences = batch.sequences[:1]  # the long one (the 1-token one only gave the group two rewards)
    return batch


class _SavedBytes:
    """Bytes of the tensors autograd saves for the backward, each storage once, parameters out."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += s.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _worker(rank: int, world: int, init_file: str, args, results) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
        os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        from megatron_rl.algorithms.config import GRPOConfig
        from megatron_rl.batching.config import BatchingConfig
        from megatron_rl.training.config import TrainerConfig
        from megatron_rl.training.parallel import ParallelConfig
        from megatron_rl.training.trainer import PolicyTrainer

        cfg = TrainerConfig(parallel=ParallelConfig(context_parallel=world), seed=0)
        trainer = PolicyTrainer(
            _hf_config(args), cfg, GRPOConfig(), BatchingConfig(token_budget=args.tokens, layout="packed")
        )
        batch = _batch(args)
        params = [p for c in trainer.chunks for p in c.parameters()]
        params += [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        trainer.forward_backward(batch, "grpo")  # warm-up
        saved = _SavedBytes(params)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            metrics = trainer.forward_backward(batch, "grpo")
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            trainer.forward_backward(batch, "grpo")
            times.append(time.perf_counter() - t0)
        peak = torch.tensor([float(saved.bytes)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(
                {
                    "cp": world,
                    "peak_activation_bytes": float(peak),
                    "step_s": statistics.median(times),
                    "loss": metrics["loss"],
                    "tokens": sum(batch.lengths),
                }
            )
        trainer.close()
    finally:
        dist.destroy_process_group()


def _run(args, cp: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(cp, os.path.join(tmp, "init"), args, results),
            nprocs=cp,
            join=True,
            start_method="spawn",
        )
    return results.get()


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokens", type=int_arg(1), default=16384, help="tokens of the one sequence (prompt 64 + completion)"
    )
    p.add_argument(
        "--cp",
        type=int_list_arg(1),
        default=[1, 2, 4],
        help="context-parallel sizes (the first is the baseline)",
    )
    p.add_argument("--hidden", type=int_arg(1), default=128)
    p.add_argument("--layers", type=int_arg(1), default=2)
    p.add_argument("--heads", type=int_arg(1), default=4)
    p.add_argument("--vocab", type=int_arg(1), default=4000)
    p.add_argument("--steps", type=int_arg(1), default=2, help="timed forward + backward passes per size")
    args = p.parse_args(argv)

    rows = {}
    for cp in args.cp:
        print(f"[long-context] CP={cp}: {cp} rank(s), {args.tokens} tokens ...", flush=True)
        rows[cp] = _run(args, cp)
    base = rows[args.cp[0]]
    print(
        f"one {args.tokens}-token sequence, tiny Llama: hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads, vocab {args.vocab}; GRPO forward + backward, packed; "
        f"{'GPU' if torch.cuda.is_available() else f'CPU, {os.cpu_count()} cores shared by the ranks'}"
    )
    print(
        f"{'CP':>3} {'peak activations / rank':>24} {'÷ CP=' + str(args.cp[0]):>9} {'step s':>8} {'loss':>12}"
    )
    for cp, r in rows.items():
        print(
            f"{cp:3d} {r['peak_activation_bytes'] / 2**20:20.1f} MiB {r['peak_activation_bytes'] / base['peak_activation_bytes']:9.3f} "
            f"{r['step_s']:8.2f} {r['loss']:12.7f}"
        )
    out = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": args.vocab,
        **{f"peak_activation_mib_cp{cp}": r["peak_activation_bytes"] / 2**20 for cp, r in rows.items()},
        **{f"step_s_cp{cp}": r["step_s"] for cp, r in rows.items()},
        **{f"loss_cp{cp}": r["loss"] for cp, r in rows.items()},
        **{
            f"memory_ratio_cp{cp}": r["peak_activation_bytes"] / base["peak_activation_bytes"]
            for cp, r in rows.items()
            if cp != args.cp[0]
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench long-context", main))
