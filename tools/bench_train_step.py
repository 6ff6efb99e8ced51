"""Time of one GRPO training step (forward, backward, optimizer): the Megatron trainer against a
plain PyTorch/HF step on the same model, batches and threads, and at TP=1 against TP=2.

    megatron-rl bench train-step [--hidden 128] [--layers 4] [--vocab 4000] [--sequences 16]
                                 [--prompt 32] [--completion 96] [--budget 1024] [--steps 5]

Each layout runs in fresh processes started here with ``torch.multiprocessing`` (gloo on CPU,
NCCL on GPUs): TP=1 on one rank, TP=2 on two (one GPU each; skipped with fewer than two GPUs).
Every rank builds the same tiny Llama-style policy (CPU initialisation does not depend on TP, so
both layouts start from the same weights and the first step's loss and gradient norm must agree)
and runs ``PolicyTrainer.rl_step`` on the same synthetic minibatch: ``--warmup`` untimed steps,
then ``--steps`` timed ones (median reported). ``--threads`` intra-op threads per rank (default 1
on CPU, so TP=2 uses two cores where TP=1 uses one: the ratio shows what splitting buys).

The baseline, in the TP=1 process (same threads): what a user would write without Megatron --
``transformers.LlamaForCausalLM`` with the same config and the trainer's initial weights (copied
through ``hf_tensors``), the same minibatch split into the same kind of microbatches under the
same token budget, the GRPO loss from the logits (fp32 log-softmax, gather the taken token,
:func:`~megatron_rl.algorithms.loss.grpo_loss` with the same weights), backward per microbatch,
``clip_grad_norm_`` to the same ``clip_grad`` and ``torch.optim.AdamW`` with the trainer's
hyper-parameters (AdamW is the class Megatron itself falls back to without Apex/TE). Its rows
are padded per microbatch with a 2-D attention mask (HF's SDPA attention): on CPU that is the
layout an HF user picks -- HF's packed layout (``position_ids`` restarting per sequence,
``DataCollatorWithFlattening``) is built for flash-attention-2 (CUDA); on CPU its SDPA and eager
paths turn packed ``position_ids`` into a dense block-diagonal ``[T, T]`` mask. Both sides are
warmed up, then timed in interleaved rounds (ours, theirs, ours, ...) so that load on shared cores
hits both alike; medians are reported. The first step of both starts from the same weights, so
their losses and gradient norms must agree (checked, reported). For our side the step splits into
forward+backward (Megatron's schedule; the output layer runs only at completion positions, see
``training/steps.py``, where the baseline computes logits at every position as HF's forward
does), optimizer (grad norm, clip, Adam) and other (collation,
grad-buffer zeroing, metric reduction), timed on the trainer's own methods.

Tokens/s counts prompt + completion tokens of the minibatch. On a GPU, MFU = 6 * params *
tokens/s / (GPUs x peak FLOP/s), the usual dense-transformer estimate (attention's own FLOPs not
counted); ``--peak-flops`` defaults to 989e12, the H100/H200 dense bf16 figure. The last line is
one JSON object: ``tokens_per_s`` (TP=1), ``plain_torch_tokens_per_s``,
``trainer_over_plain_torch`` (ours / theirs), ``tp2_over_tp1_step_time``, and ``mfu`` on GPU.
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

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, run_cli


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
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import OptimConfig, TrainerConfig
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.trainer import PolicyTrainer

    cfg = TrainerConfig(
        parallel=ParallelConfig(tensor_parallel=tp), optim=OptimConfig(lr=1e-5), seed=args.seed
    )
    return PolicyTrainer(_hf_config(args), cfg, GRPOConfig(), BatchingConfig(token_budget=args.budget))


def _hf_config(args):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn or 4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=4 * args.budget,
        rms_norm_eps=1e-5,
    )


class _Phases:
    """Seconds spent in named methods of one object, summed until :meth:`take` (instrumentation
    of the trainer's own methods: the calls go through unchanged)."""

    def __init__(self, obj, **methods: str) -> None:
        self.spent = dict.fromkeys(methods.values(), 0.0)
        for method, phase in methods.items():
            setattr(obj, method, self._timed(getattr(obj, method), phase))

    def _timed(self, fn, phase: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[phase] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, dict.fromkeys(self.spent, 0.0)
        return out


def _plain_torch(trainer, args):
    """The baseline's model and optimizer: ``LlamaForCausalLM`` holding the trainer's current
    weights (HF names from ``hf_tensors``), AdamW with the trainer's hyper-parameters."""
    import transformers

    model = transformers.LlamaForCausalLM(_hf_config(args)).to(trainer.device)
    state = {name: t for name, t in trainer.hf_tensors()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(
            f"weights do not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
        )
    model.train()
    o = trainer.cfg.optim
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
    )
    return model, opt


def _plain_step(model, opt, batch, args, clip_grad: float) -> dict[str, float]:
    """One plain PyTorch GRPO step: padded microbatches, HF forward, log-softmax gather, the GRPO
    loss, backward per microbatch, clip, AdamW. Returns loss, grad norm and phase seconds."""
    from megatron_rl.algorithms.loss import grpo_loss
    from megatron_rl.batching.collate import build_microbatches

    t0 = time.perf_counter()
    mbs = build_microbatches(batch, args.budget, layout="padded")
    t1 = time.perf_counter()
    total = 0.0
    for mb in mbs:
        s = mb.tokens.shape[1]
        mask = (torch.arange(s)[None, :] < torch.tensor(mb.seq_lengths)[:, None]).long()
        logits = model(input_ids=mb.tokens, attention_mask=mask, use_cache=False).logits
        logp = logits.float().log_softmax(-1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
        loss, _ = grpo_loss(logp, mb.behaviour_logprobs, mb.advantages, mb.loss_weights)
        loss.backward()
        total += float(loss.detach())
    t2 = time.perf_counter()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad))
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return {
        "loss": total,
        "grad_norm": norm,
        "step_s": t3 - t0,
        "fwd_bwd_s": t2 - t1,
        "optimizer_s": t3 - t2,
        "other_s": t1 - t0,
    }


def _our_step(trainer, phases: _Phases, batch) -> dict[str, float]:
    """One ``rl_step`` timed from outside, split into the phases of its own methods."""
    t0 = time.perf_counter()
    m = trainer.rl_step(batch)
    step = time.perf_counter() - t0
    spent = phases.take()
    return {
        "loss": m["loss"],
        "grad_norm": m["grad_norm"],
        "microbatches": m["microbatches"],
        "padding": m["padding_fraction"],
        "step_s": step,
        "fwd_bwd_s": spent["fwd_bwd"],
        "optimizer_s": spent["optimizer"],
        "other_s": step - spent["fwd_bwd"] - spent["optimizer"],
    }


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _worker(rank: int, world: int, init_file: str, args, results) -> None:
    """One rank: build the trainer at TP = ``world``, run the steps (at TP=1 interleaved with the
    plain PyTorch baseline's), rank 0 reports."""
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
        baseline = world == 1 and not args.no_baseline
        if baseline:  # before our first step: both start from the same weights
            model, opt = _plain_torch(trainer, args)
        phases = _Phases(trainer, _run="fwd_bwd", _nonfinite="optimizer", _clip_and_step="optimizer")
        ours, theirs = [], []
        for _ in range(args.warmup + args.steps):
            ours.append(_our_step(trainer, phases, batch))
            if baseline:
                theirs.append(_plain_step(model, opt, batch, args, trainer.cfg.optim.clip_grad))
        first, timed = ours[0], ours[args.warmup :]
        params = trainer.num_parameters()  # collective
        if rank == 0:
            row = {
                "ranks": world,
                "params": params,
                "padded_vocab": trainer.chunks[0].vocab_size,
                "tokens": sum(batch.lengths),
                "sequences": len(batch),
                "microbatches": first["microbatches"],
                "padding": first["padding"],
                "loss": first["loss"],
                "grad_norm": first["grad_norm"],
                **{k: _median(timed, k) for k in ("step_s", "fwd_bwd_s", "optimizer_s", "other_s")},
            }
            if baseline:
                timed_theirs = theirs[args.warmup :]
                row["plain"] = {
                    "loss": theirs[0]["loss"],
                    "grad_norm": theirs[0]["grad_norm"],
                    **{
                        k: _median(timed_theirs, k) for k in ("step_s", "fwd_bwd_s", "optimizer_s", "other_s")
                    },
                }
            results.put(row)
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
    sides = [("Megatron trainer (TP=1)", base)]
    if "plain" in base:
        sides.append(("plain PyTorch/HF", base["plain"]))
    print(
        f"\n{'per phase, median s':24} {'fwd+bwd':>9} {'optimizer':>10} {'other':>8} {'step':>8} {'tokens/s':>10}"
    )
    for name, r in sides:
        print(
            f"{name:24} {r['fwd_bwd_s']:9.3f} {r['optimizer_s']:10.3f} {r['other_s']:8.3f} "
            f"{r['step_s']:8.3f} {base['tokens'] / r['step_s']:10.0f}"
        )


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int_arg(1), default=128)
    ap.add_argument("--layers", type=int_arg(1), default=4)
    ap.add_argument("--heads", type=int_arg(1), default=8)
    ap.add_argument("--kv-heads", type=int_arg(1), default=4)
    ap.add_argument(
        "--ffn", type=int_arg(0, note=" (0: the default width)"), default=0, help="MLP width (0: 4 x hidden)"
    )
    ap.add_argument("--vocab", type=int_arg(1), default=4000)
    ap.add_argument("--sequences", type=int_arg(1), default=16, help="completions per minibatch")
    ap.add_argument("--group-size", type=int_arg(1), default=8, help="completions per prompt")
    ap.add_argument("--prompt", type=int_arg(1), default=32, help="prompt tokens")
    ap.add_argument("--completion", type=int_arg(1), default=96, help="longest completion (half to full)")
    ap.add_argument("--budget", type=int_arg(1), default=1024, help="microbatch token budget")
    ap.add_argument("--warmup", type=int_arg(1), default=2, help="untimed steps first (>= 1)")
    ap.add_argument("--steps", type=int_arg(1), default=5, help="timed steps")
    ap.add_argument("--threads", type=int_arg(1), default=1, help="intra-op threads per rank")
    ap.add_argument(
        "--peak-flops",
        type=float_arg(0.0, low_open=True),
        default=989e12,
        help="per-GPU peak FLOP/s for MFU (H100/H200 dense bf16: 989e12)",
    )
    ap.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain PyTorch/HF baseline")
    args = ap.parse_args(argv)
    args.warmup = max(1, args.warmup)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    layouts = [1, 2] if gpus != 1 else [1]  # TP=2 on GPUs needs two of them
    rows = {tp: _run_layout(args, tp) for tp in layouts}
    for r in rows.values():
        r["tokens_per_s"] = r["tokens"] / r["step_s"]
    _table(args, rows)
    out = {"tokens_per_s": round(rows[1]["tokens_per_s"], 1), "step_time_s": round(rows[1]["step_s"], 4)}
    plain = rows[1].get("plain")
    if plain is not None:
        plain_tps = rows[1]["tokens"] / plain["step_s"]
        out["plain_torch_tokens_per_s"] = round(plain_tps, 1)
        out["trainer_over_plain_torch"] = round(rows[1]["tokens_per_s"] / plain_tps, 4)
        # Same weights, same batch: the first steps agree up to fp32 reordering (~1e-6 relative).
        out["plain_torch_first_step_match"] = all(
            abs(plain[k] - rows[1][k]) <= 1e-4 * max(1.0, abs(rows[1][k])) for k in ("loss", "grad_norm")
        )
        print(
            f"trainer / plain PyTorch tokens/s: {out['trainer_over_plain_torch']:.3f} (goal >= 1.0); "
            f"first-step loss and grad norm {'match' if out['plain_torch_first_step_match'] else 'DIFFER'}"
            f" ({rows[1]['loss']:.6f} / {plain['loss']:.6f}, {rows[1]['grad_norm']:.6f} / {plain['grad_norm']:.6f})"
        )
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


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench train-step", main))
