"""Generation throughput on RL's workload: the built-in engine server over HTTP against HF
``model.generate`` at its best batch size.

    megatron-rl bench generation [--groups 16] [--group-size 8] [--in-flight 8] [--median-len 64]
                                 [--sigma 1.0] [--l-max 384] [--prompt-len 48-96] [--threads 1]
                                 [--hf-batches 16,32,64,128] [--repeats 2]

**Workload** (what a GRPO generation phase asks of a generator): ``--groups`` prompts of random
lengths in ``--prompt-len``, each sampled ``--group-size`` times (a group shares its prompt);
completion lengths long-tailed as the paper's, lognormal (median ``--median-len``, log-space
sigma ``--sigma``) cut at ``--l-max``, drawn once and identical for both sides: each sample ends
at its length exactly as if it had sampled EOS there (the engine: the request's
``max_new_tokens``; HF: a per-row ``StoppingCriteria``, the mechanism ``generate`` itself uses for
EOS, so a finished row is padded while the rest of its batch goes on). Requests arrive
continuously, as in the RL loop: ``--in-flight`` groups are outstanding at once, and a new group
is sent as soon as one completes. Sampling: temperature 1.0 over the full vocabulary. The model:
one random Llama-style model (fp32, saved with ``save_pretrained``; its figures are printed).

**Baseline**: HF transformers ``model.generate`` in this process (``do_sample``, ``use_cache``,
``num_return_sequences`` = group size, left padding), which is what a user without a serving
engine writes. It cannot take requests mid-batch, so it runs the groups batch after batch in
arrival order; its batch size (sequences) is swept over ``--hf-batches`` and the best one is the
baseline (a large batch amortises the weights, a small one wastes less on finished rows).

**Engine**: the built-in engine server (``EngineProcess``, ``in-flight x group-size`` slots)
through ``FleetClient.submit``, one HTTP request per sample.

Both use ``--threads`` torch threads. Each side runs once untimed on a few short requests; HF's
batch sizes are then timed once each, and the best one is run ``--repeats`` times alternating
with the engine (so a busy spell of a shared machine hits both alike), median reported.
Tokens/s counts generated tokens (the drawn lengths). The engine's row also shows how much of
its wall time the server spent in engine steps, and how many prompt tokens it prefilled (one
prefill per group). The last line is one JSON object; ``engine_over_hf_generate`` = engine
tokens/s / HF tokens/s at HF's best batch size.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, int_list_arg, run_cli


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # one per group
    lengths: list[list[int]]  # [group][sample]: completion tokens

    @property
    def tokens(self) -> int:
        return sum(map(sum, self.lengths))


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    lo, hi = args.prompt_len
    prompts = [[rng.randrange(args.vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.groups)]
    lengths = [
        [
            min(args.l_max, max(1, round(args.median_len * math.exp(rng.gauss(0.0, args.sigma)))))
            for _ in range(args.group_size)
        ]
        for _ in range(args.groups)
    ]
    return Workload(prompts=prompts, lengths=lengths)


def make_model(folder: str, args: argparse.Namespace) -> int:
    """Save a random fp32 Llama without EOS to ``folder``; returns its parameter count."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=11 * args.hidden // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len[1] + args.l_max,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _server_stats(fleet, url: str) -> tuple[float, int]:
    state = fleet.server_info(url)["internal_states"][0]
    return float(state["busy_s"]), int(state["prefill_tokens"])


def drive_groups(
    send: Callable[[int], list[Future]], n_groups: int, in_flight: int, on_result: Callable[[object], None]
) -> None:
    """The RL workload's request pattern: ``in_flight`` groups outstanding, the next group sent
    (``send(g)`` returns its futures) as soon as one completes; ``on_result(result)`` for every
    sample as it ends. ``tools/gpu_check_sglang.py`` drives SGLang with it too."""
    outstanding: dict[int, set[Future]] = {}
    owner: dict[Future, int] = {}
    nxt = 0
    while nxt < n_groups or outstanding:
        while nxt < n_groups and len(outstanding) < in_flight:
            futs = send(nxt)
            outstanding[nxt] = set(futs)
            owner.update((f, nxt) for f in futs)
            nxt += 1
        done, _ = wait([f for fs in outstanding.values() for f in fs], return_when=FIRST_COMPLETED)
        for f in done:
            g = owner.pop(f)
            on_result(f.result())
            outstanding[g].discard(f)
            if not outstanding[g]:
                del outstanding[g]


def engine_run(fleet, url: str, w: Workload, in_flight: int, tag: str) -> tuple[float, int, float, int]:
    """(seconds, generated tokens, server busy seconds, prefilled tokens): ``in_flight`` groups
    outstanding, the next group sent when one completes."""
    from megatron_rl.generation.api import GenRequest

    def send(g: int) -> list[Future]:
        return [
            fleet.submit(
                GenRequest(
                    request_id=f"{tag}-{g}-{k}",
                    input_ids=w.prompts[g],
                    max_new_tokens=n,
                    temperature=1.0,
                    seed=g * 1000 + k,
                )
            )
            for k, n in enumerate(w.lengths[g])
        ]

    tokens = 0

    def count(res) -> None:
        nonlocal tokens
        if res.finish_reason != "length":
            raise SystemExit(f"bench generation: the engine ended a sample with {res.finish_reason}")
        tokens += len(res.token_ids)

    busy, prefill = _server_stats(fleet, url)
    start = time.perf_counter()
    drive_groups(send, len(w.prompts), in_flight, count)
    seconds = time.perf_counter() - start
    busy2, prefill2 = _server_stats(fleet, url)
    if tokens != w.tokens:
        raise SystemExit(f"bench generation: the engine wrote {tokens} tokens, not {w.tokens}")
    return seconds, tokens, busy2 - busy, prefill2 - prefill


def hf_run(model, w: Workload, group_size: int, batch: int) -> tuple[float, int]:
    """(seconds, generated tokens) for HF ``generate``, groups in order, ``batch`` sequences
    (whole groups) per call, each row stopped at its drawn length."""
    import transformers

    class StopAtLength(transformers.StoppingCriteria):
        def __init__(self, lengths: list[int], start: int):
            self.lengths, self.start = torch.tensor(lengths), start

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            return torch.full_like(self.lengths, input_ids.shape[1] - self.start) >= self.lengths

    per = max(1, batch // group_size)
    start = time.perf_counter()
    tokens = 0
    for b in range(0, len(w.prompts), per):
        prompts, lengths = w.prompts[b : b + per], w.lengths[b : b + per]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        flat = [n for ns in lengths for n in ns]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=group_size,
                max_new_tokens=max(flat),
                use_cache=True,
                pad_token_id=0,
                stopping_criteria=transformers.StoppingCriteriaList([StopAtLength(flat, width)]),
            )
        if out.shape[1] - width != max(flat):
            raise SystemExit(f"bench generation: HF wrote {out.shape[1] - width} tokens, not {max(flat)}")
        tokens += sum(flat)
    return time.perf_counter() - start, tokens


def run(args: argparse.Namespace, folder: str) -> dict:
    import transformers

    from megatron_rl.generation.client import FleetClient
    from megatron_rl.generation.engine.launch import EngineProcess

    params = make_model(folder, args)
    w = make_workload(args)
    warm = Workload(prompts=[p[:4] for p in w.prompts[:2]], lengths=[[4] * args.group_size] * 2)
    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    slots = args.in_flight * args.group_size
    flat = sorted(n for ns in w.lengths for n in ns)
    print(
        f"generation: random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
        f"({params / 1e6:.2f}M parameters, fp32), {args.threads} torch thread(s) each side; "
        f"{args.groups} groups x {args.group_size} samples, prompts {args.prompt_len[0]}-"
        f"{args.prompt_len[1]} tokens; lengths lognormal median {args.median_len} sigma {args.sigma} "
        f"cut at {args.l_max}: mean {statistics.fmean(flat):.0f}, p95 {flat[int(0.95 * (len(flat) - 1))]}, "
        f"max {flat[-1]}; {w.tokens} tokens; {args.in_flight} groups in flight",
        flush=True,
    )
    hf_run(model, warm, args.group_size, 2 * args.group_size)  # untimed
    sweep = {}
    for b in args.hf_batches:
        sweep[b] = hf_run(model, w, args.group_size, b)[0]
        print(
            f"  HF generate, batch {b:4d}: {sweep[b]:7.2f} s  {w.tokens / sweep[b]:7.0f} tokens/s", flush=True
        )
    best = min(sweep, key=lambda b: sweep[b])
    hf_rows, engine_rows = [sweep[best]], []
    api_key = secrets.token_urlsafe(32)  # our server is never open, not even on loopback
    max_len = args.prompt_len[1] + args.l_max
    with EngineProcess(
        folder, max_slots=slots, max_len=max_len, threads=args.threads, api_key=api_key
    ) as server:
        fleet = FleetClient([server.url], api_key=api_key)
        engine_run(fleet, server.url, warm, args.in_flight, "warm")  # untimed
        for r in range(args.repeats):
            engine_rows.append(engine_run(fleet, server.url, w, args.in_flight, f"r{r}"))
            if r + 1 < args.repeats:
                hf_rows.append(hf_run(model, w, args.group_size, best)[0])
            print(f"  repeat {r + 1}/{args.repeats} done", flush=True)
        fleet.close()
    hf_s = statistics.median(hf_rows)
    engine_s = statistics.median(s for s, *_ in engine_rows)
    busy_s = statistics.median(b for _, _, b, _ in engine_rows)
    prefill = engine_rows[0][3]
    hf_tps, engine_tps = w.tokens / hf_s, w.tokens / engine_s
    print(f"{'generator':58} {'seconds':>8} {'tokens/s':>9} {'÷ HF':>6}")
    print(f"{f'HF model.generate, best batch {best} (baseline)':58} {hf_s:8.3f} {hf_tps:9.0f} {1.0:6.2f}")
    print(
        f"{f'built-in engine over HTTP (FleetClient), {slots} slots':58} {engine_s:8.3f} "
        f"{engine_tps:9.0f} {engine_tps / hf_tps:6.2f}"
    )
    print(f"{'  of which in engine steps (server busy)':58} {busy_s:8.3f}")
    print(
        f"  prompt tokens prefilled by the engine: {prefill} (HF: {sum(map(len, w.prompts)) * args.group_size})"
    )
    return {
        "engine_over_hf_generate": round(engine_tps / hf_tps, 4),
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "hf_best_batch": best,
        "hf_tokens_per_s_by_batch": {str(b): round(w.tokens / s, 1) for b, s in sweep.items()},
        "engine_s": round(engine_s, 4),
        "engine_busy_s": round(busy_s, 4),
        "hf_s": round(hf_s, 4),
        "generated_tokens": w.tokens,
        "engine_prefill_tokens": prefill,
        "threads": args.threads,
        "params": params,
    }


def _range(text: str) -> tuple[int, int]:
    """``LO-HI`` (or one number): token counts with 1 <= LO <= HI."""
    lo, _, hi = text.partition("-")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be LO-HI token counts, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"must be LO-HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int_arg(1), default=256)
    ap.add_argument("--layers", type=int_arg(1), default=4)
    ap.add_argument("--heads", type=int_arg(1), default=4)
    ap.add_argument("--kv-heads", type=int_arg(1), default=2)
    ap.add_argument("--vocab", type=int_arg(1), default=1000)
    ap.add_argument("--groups", type=int_arg(1), default=16, help="prompts")
    ap.add_argument("--group-size", type=int_arg(1), default=8, help="samples per prompt")
    ap.add_argument(
        "--in-flight",
        type=int_arg(1),
        default=8,
        help="groups outstanding at once (engine slots / group size)",
    )
    ap.add_argument("--prompt-len", type=_range, default=(48, 96), help="prompt tokens, LO-HI")
    ap.add_argument("--median-len", type=int_arg(1), default=64, help="median completion tokens")
    ap.add_argument("--sigma", type=float_arg(0.0), default=1.0, help="lognormal sigma of the lengths")
    ap.add_argument("--l-max", type=int_arg(1), default=384, help="completion length cut")
    ap.add_argument(
        "--hf-batches", type=int_list_arg(1), default=[16, 32, 64, 128], help="transformers batch sizes"
    )
    ap.add_argument("--threads", type=int_arg(1), default=1, help="torch threads, for each generator")
    ap.add_argument("--repeats", type=int_arg(1), default=2, help="timed runs of each (median)")
    ap.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as folder:
        out = run(args, folder)
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench generation", main))
