"""Asynchronous against synchronous GRPO loop on a long-tailed completion-length workload.

    megatron-rl bench async [--steps 6] [--servers 2] [--slots 32] [--l-max 512] [--decode-ms 10]
    megatron-rl bench async --real [--steps 2]      # the tiny model, trainer and weight sync

Magistral (section 3) runs the loop asynchronously because completion lengths are long-tailed:
most completions are short, a few run to the length limit, and a synchronous step waits for the
longest of its batch while the rest of the fleet idles. This program runs the *same* workload in
both loop modes in one run -- ``loop.mode: sync`` first, then ``async``, each from policy version
0, with the same seeds, the same number of steps and ``n_batch`` sequences per step -- and
reports the wall-time ratio (``async_speedup`` = sync wall / async wall) and how busy the
generators were in each.

**What runs.** The real orchestration: :class:`~megatron_rl.orchestration.loop.Orchestrator`
over :class:`~megatron_rl.orchestration.rollouts.Rollouts`, the real ``FleetClient`` over HTTP,
the real ``VerifierPool`` scoring every completion (format, math-verify, length penalty), real
``megatron-rl serve-engine`` processes (``EngineProcess``). The default mode (``timing-model``)
replaces only the two compute-bound parts, because on a 2-core machine a real engine and a real
trainer fight for the same cores and the figure would measure that contention, not scheduling:

- the servers run ``--timing-model`` (``generation/engine/timing.py``): a step sleeps
  ``decode_s + decode_s_per_seq * batch + prefill_s_per_token * admitted prompt tokens`` and
  writes the tokens of a script (the completion a request's sampling seed picks);
- the trainer sleeps ``train_s_per_token * tokens`` per optimizer step; its weight update pauses
  the fleet in place, sets the servers' weight version (``/update_weight_version``, requests kept)
  and resumes.

``--real`` runs the real tiny model in the servers, a real ``PolicyTrainer`` and the real
``WeightBroadcaster`` instead (after a short SFT on the script, so that the model writes the
format with long-tailed lengths and mixed answers); on 2 cores it is slow and contended.

**Workload.** Problems are ``--problems`` variants of "What is 2 + 2?" (answer 4). The script
holds ``--script`` completions ``<think> filler </think>The answer is \\boxed{4}.`` (or
``\\boxed{5}``, wrong, with probability ``1 - --p-correct``) plus EOS, whose lengths are lognormal
(median ``--median-len``, log-space sigma ``--sigma``); lengths beyond ``--l-max`` are cut by
``max_new_tokens`` and fail the format check (reward 0). Rewards within a group
differ (correctness, the length penalty), so groups are kept and long ones stall a sync step.

**Figures.** ``generator_busy_<mode>``: the servers' own accounting, the sum of their engine step
times over the mode's wall time and the number of servers (``/server_info``
``internal_states.busy_s``); ``client_busy_<mode>``: the orchestrator's ``generator/busy_fraction``
(any request in flight), averaged over steps; ``slot_occupancy_<mode>``: generated tokens per
engine step over the slots (a sync step's tail runs steps with a nearly empty batch; tokens are
counted when their request finishes). The last line is one JSON object.

Time: ~70 s with the defaults on 2 shared cores (both loops, ~10 s of set-up); ``--real`` ~2.5 min,
most of it the SFT.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ANSWER, WRONG = "4", "5"
FILLER = " so we add two and two, then we check the sum once more"


# ---------------------------------------------------------------------- workload


@dataclass
class Workload:
    """Files of one run, and the objects built from them."""

    problems: list  # megatron_rl.data.problems.Problem
    tokenizer: object
    tokenizer_dir: Path
    init: Path  # HF folder (random tiny Llama): config, EOS and tokenizer for the servers
    script: list[list[int]]  # completion token ids (EOS-terminated unless cut)
    script_path: Path  # the timing model's JSON
    lengths: list[int]  # completion tokens per script entry as generated (after the l_max cut)


def _scripted(tok, n: int, args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Completions with lognormal lengths, right or wrong; and their lengths after the cut."""
    from megatron_rl.quickstart.tokenizer import text_ids
    from megatron_rl.rewards.template import THINK_CLOSE, THINK_OPEN

    rng = random.Random(args.seed)
    head, filler = text_ids(tok, THINK_OPEN), text_ids(tok, FILLER)
    tails = {
        a: text_ids(tok, f"{THINK_CLOSE}The answer is \\boxed{{{a}}}.") + [tok.eos_token_id]
        for a in (ANSWER, WRONG)
    }
    script, lengths = [], []
    for _ in range(n):
        tail = tails[ANSWER if rng.random() < args.p_correct else WRONG]
        length = round(args.median_len * math.exp(args.sigma * rng.gauss(0.0, 1.0)))
        # Past l_max the engine cuts the completion before its answer (max_new_tokens).
        length = min(max(length, len(head) + 1 + len(tail)), args.l_max + len(tail))
        k = length - len(head) - len(tail)
        script.append(head + (filler * (k // len(filler) + 1))[:k] + tail)
        lengths.append(min(length, args.l_max))
    return script, lengths


def build_workload(root: Path, args: argparse.Namespace) -> Workload:
    from megatron_rl.data.problems import Problem
    from megatron_rl.quickstart.model import TinyModelConfig, build_model_folder
    from megatron_rl.quickstart.tokenizer import QUICKSTART_SYSTEM_PROMPT, build_tokenizer, load_tokenizer
    from megatron_rl.rewards.template import MATH_INSTRUCTION, THINK_CLOSE, THINK_OPEN

    problems = [
        Problem(
            id=f"two-plus-two-{i:04d}", problem=f"What is 2 + 2? (question {i})", task="math", answer=ANSWER
        )
        for i in range(args.problems)
    ]
    corpus = [QUICKSTART_SYSTEM_PROMPT, MATH_INSTRUCTION, *(p.problem for p in problems)]
    corpus += [f"{THINK_OPEN}{FILLER}{THINK_CLOSE}The answer is \\boxed{{{a}}}." for a in (ANSWER, WRONG)]
    tok_dir = build_tokenizer(corpus, root / "tokenizer")
    tok = load_tokenizer(tok_dir)
    init = build_model_folder(TinyModelConfig(max_positions=args.max_len), tok_dir, root / "init")
    script, lengths = _scripted(tok, args.script, args)
    timing = {
        "decode_s": args.decode_ms / 1e3,
        "decode_s_per_seq": args.decode_ms_per_seq / 1e3,
        "prefill_s_per_token": args.prefill_ms_per_token / 1e3,
        "script": script,
    }
    path = root / "timing.json"
    path.write_text(json.dumps(timing))
    return Workload(problems, tok, tok_dir, init, script, path, lengths)


# ---------------------------------------------------------------------- stand-ins (default mode)


class ModeledTrainer:
    """A trainer whose optimizer step takes ``s_per_token`` seconds per token of its batch
    (prompt + completion): a step's compute is linear in its tokens."""

    def __init__(self, s_per_token: float):
        self.s_per_token = s_per_token
        self.step = 0

    def rl_step(self, batch) -> dict[str, float]:
        tokens = sum(batch.lengths)
        seconds = self.s_per_token * tokens
        time.sleep(seconds)
        self.step += 1
        return {"step_time_s": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}


def _post(url: str, route: str, body: dict, api_key: str) -> dict:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


class VersionBroadcaster:
    """A weight update with no weights: pause in place, set the version, wait ``hold_s`` (the
    transfer), resume. Running requests keep going; later tokens carry the new version."""

    def __init__(self, fleet, api_key: str, hold_s: float = 0.0):
        self.fleet, self.api_key, self.hold_s = fleet, api_key, hold_s

    def sync(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.fleet.pause("in_place")
        try:
            for url in self.fleet.update_urls:
                _post(
                    url,
                    "/update_weight_version",
                    {"new_version": str(version), "abort_all_requests": False},
                    self.api_key,
                )
            time.sleep(self.hold_s)
        finally:
            self.fleet.resume()
        return {"weight_sync/seconds": time.perf_counter() - t0, "weight_sync/version": float(version)}


# ---------------------------------------------------------------------- real mode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sft_on_script(w: Workload, root: Path, args: argparse.Namespace) -> Path:
    """A short SFT of the tiny model on (prompt, script entry) pairs, so that it samples the
    format with the script's lengths and answers; returns the HF folder."""
    from megatron_rl.batching.sft import build_sft_batch
    from megatron_rl.data.sampling import render_prompt
    from megatron_rl.quickstart.sft import make_trainer
    from megatron_rl.quickstart.tokenizer import QUICKSTART_SYSTEM_PROMPT

    rng = random.Random(args.seed)
    prompts = [
        render_prompt(w.tokenizer, p.problem, "math", system_prompt=QUICKSTART_SYSTEM_PROMPT)
        for p in w.problems
    ]
    entries = [s for s in w.script if len(s) <= args.l_max]
    trainer = make_trainer(w.init, lr=3e-3, min_lr=3e-4, warmup_steps=5, decay_steps=args.sft_steps)
    try:
        t0 = time.perf_counter()
        for _i in range(args.sft_steps):
            pairs = [(rng.choice(prompts), rng.choice(entries)) for _ in range(32)]
            loss = trainer.sft_step(build_sft_batch(pairs))["loss"]
        print(
            f"[real] sft: {args.sft_steps} steps, last loss {loss:.3f}, {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        return Path(trainer.export_hf(root / "sft", like=w.init))
    finally:
        trainer.close()


class RealParts:
    """The real trainer and weight broadcaster; :meth:`reset` puts both back to version 0."""

    def __init__(self, folder: Path, fleet, cfg, args: argparse.Namespace):
        from megatron_rl.quickstart.sft import make_trainer
        from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig

        self.folder = folder
        self.trainer = make_trainer(folder, lr=args.lr, grpo=cfg.algorithm)
        self.broadcaster = WeightBroadcaster(
            self.trainer.hf_tensors, fleet, WeightSyncConfig(backend="gloo", master_port=_free_port())
        )
        self.broadcaster.connect()

    def reset(self) -> None:
        """Same start for each mode: the SFT weights at version 0 in trainer and fleet (the
        optimizer's moments carry over from the previous mode)."""
        self.trainer.load_hf(self.folder)
        self.trainer.step = 0
        self.broadcaster.sync(0)

    def close(self) -> None:
        self.broadcaster.close()
        self.trainer.close()


# ---------------------------------------------------------------------- one mode


def run_config(mode: str, args: argparse.Namespace):
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.orchestration.config import LoopConfig
    from megatron_rl.orchestration.recipe import RunConfig
    from megatron_rl.rewards.compose import RewardConfig

    return RunConfig(
        loop=LoopConfig(
            mode=mode,
            group_size=args.group_size,
            n_batch=args.n_batch,
            n_async=args.n_async,
            max_steps=args.steps,
            seed=args.seed,
        ),
        reward=RewardConfig(l_max=args.l_max, l_cache=args.l_max // 4, workers=args.workers),
        algorithm=GRPOConfig(),
    )


def _server_stats(fleet) -> list[dict]:
    return [fleet.server_info(s.url)["internal_states"][0] for s in fleet.servers]


def run_mode(
    mode: str, w: Workload, fleet, pool, args: argparse.Namespace, real: RealParts | None, api_key: str
) -> dict:
    """``args.steps`` steps of the loop in ``mode`` from version 0; wall time and busy figures."""
    from megatron_rl.orchestration.loop import Orchestrator
    from megatron_rl.orchestration.rollouts import Rollouts
    from megatron_rl.orchestration.sampler import PromptSampler
    from megatron_rl.quickstart.tokenizer import QUICKSTART_SYSTEM_PROMPT

    cfg = run_config(mode, args)
    if real is not None:
        real.reset()
        trainer, broadcaster = real.trainer, real.broadcaster
    else:
        trainer = ModeledTrainer(args.train_ms_per_token / 1e3)
        broadcaster = VersionBroadcaster(fleet, api_key, args.sync_ms / 1e3)
        broadcaster.sync(0)
    rollouts = Rollouts.from_config(
        cfg,
        fleet=fleet,
        pool=pool,
        sampler=PromptSampler(w.problems, seed=cfg.loop.seed),
        tokenizer=w.tokenizer,
        system_prompt=QUICKSTART_SYSTEM_PROMPT,
        version=lambda: int(trainer.step),
    )
    orch = Orchestrator(cfg, trainer=trainer, broadcaster=broadcaster, rollouts=rollouts)
    before = _server_stats(fleet)
    metrics: list[dict] = []
    t0 = time.monotonic()
    try:
        orch.start()
        for _ in range(args.steps):
            m = orch.step().metrics
            metrics.append(m)
            print(
                f"[{mode}] step {int(m['step'])}: {m['time/step_s']:.2f} s, wait "
                f"{m['time/wait_for_batch_s']:.2f} s, train {m['time/train_s']:.2f} s, "
                f"reward {m.get('reward/mean', 0):.2f}, length {m.get('length/mean', 0):.0f} "
                f"(max {m.get('length/max', 0):.0f}), dropped {m['groups/dropped']:.0f}",
                file=sys.stderr,
                flush=True,
            )
        wall = time.monotonic() - t0
        after = _server_stats(fleet)
    finally:
        orch.stop()
        fleet.abort()  # async leaves requests in flight: end them before the next mode
        _drain(rollouts)
    return _summary(mode, wall, before, after, metrics, args)


def _drain(rollouts, timeout_s: float = 30.0) -> None:
    rollouts.wait_until(lambda: rollouts.in_flight == 0, timeout=timeout_s)


def _summary(
    mode: str,
    wall: float,
    before: list[dict],
    after: list[dict],
    metrics: list[dict],
    args: argparse.Namespace,
) -> dict:
    servers = len(before)
    delta = {
        k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in ("busy_s", "steps", "generated_tokens")
    }
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in metrics)
    return {
        "mode": mode,
        "wall_s": wall,
        "steps": len(metrics),
        "generator_busy": min(1.0, delta["busy_s"] / (wall * servers)),
        "client_busy": mean("generator/busy_fraction"),
        "slot_occupancy": delta["generated_tokens"] / max(1, delta["steps"] * args.slots),
        "generated_tokens_per_s": delta["generated_tokens"] / wall,
        "trained_sequences": sum(m.get("sequences", 0.0) for m in metrics),
        "length_mean": mean("length/mean"),
        "staleness_mean": mean("staleness/mean"),
        "dropped_groups": sum(m.get("groups/dropped", 0.0) for m in metrics),
        "stale_groups": sum(m.get("groups/dropped/stale", 0.0) for m in metrics),
    }


# ---------------------------------------------------------------------- the run


def start_servers(folder: Path, w: Workload, root: Path, args: argparse.Namespace, api_key: str) -> list:
    """``args.servers`` engine processes (tracked by PID, stopped by us), wanting ``api_key``.
    Started from this thread: a server dies with the *thread* that started it
    (``PR_SET_PDEATHSIG``), so a short-lived starter thread would take it down on exit."""
    from megatron_rl.generation.engine.launch import EngineProcess

    extra = [] if args.real else ["--timing-model", str(w.script_path)]
    procs = []
    try:
        for i in range(args.servers):
            procs.append(
                EngineProcess(
                    folder,
                    max_slots=args.slots,
                    max_len=args.max_len,
                    threads=1,
                    log_path=root / f"engine-{i}.log",
                    extra_args=extra,
                    api_key=api_key,
                ).start()
            )
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def run(args: argparse.Namespace, root: Path) -> dict:
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.rewards.pool import VerifierPool

    w = build_workload(root, args)
    folder = sft_on_script(w, root, args) if args.real else w.init
    api_key = secrets.token_urlsafe(32)  # our servers are never open, not even on loopback
    procs = start_servers(folder, w, root, args, api_key)
    fleet = real = None
    try:
        fleet = FleetClient([p.url for p in procs], api_key=api_key)
        real = RealParts(folder, fleet, run_config("sync", args), args) if args.real else None
        with VerifierPool(args.workers) as pool:
            results = {
                mode: run_mode(mode, w, fleet, pool, args, real, api_key) for mode in ("sync", "async")
            }
    finally:
        if real is not None:
            real.close()
        if fleet is not None:
            fleet.close()
        for p in procs:
            p.stop()
    return report(results, w, args)


def report(results: dict[str, dict], w: Workload, args: argparse.Namespace) -> dict:
    sync, asy = results["sync"], results["async"]
    kind = "real" if args.real else "timing-model"
    lengths = sorted(w.lengths)
    cut = sum(n >= args.l_max for n in lengths) / len(lengths)
    what = (
        "real tiny model, PolicyTrainer, WeightBroadcaster"
        if args.real
        else "engine servers sleep a cost model, the trainer sleeps per token"
    )
    print(
        f"mode: {kind} ({what}); {args.servers} servers x {args.slots} slots, "
        f"G={args.group_size}, n_batch={args.n_batch}, n_async={args.n_async}, "
        f"{args.steps} steps per loop mode"
    )
    print(
        f"workload: completion length median {statistics.median(lengths):.0f}, mean "
        f"{statistics.fmean(lengths):.0f}, p95 {lengths[int(0.95 * (len(lengths) - 1))]}, "
        f"{100 * cut:.1f}% cut at l_max={args.l_max}"
    )
    print(
        f"{'loop':6} {'wall s':>7} {'s/step':>7} {'÷ sync':>7} {'gen busy':>9} "
        f"{'client busy':>12} {'slot occ':>9} {'gen tok/s':>10} {'stale':>6}"
    )
    for r in (sync, asy):
        print(
            f"{r['mode']:6} {r['wall_s']:7.2f} {r['wall_s'] / r['steps']:7.2f} "
            f"{r['wall_s'] / sync['wall_s']:7.2f} {r['generator_busy']:9.2f} "
            f"{r['client_busy']:12.2f} {r['slot_occupancy']:9.2f} "
            f"{r['generated_tokens_per_s']:10.0f} {r['staleness_mean']:6.2f}"
        )
    out = {
        "mode": kind,
        "async_speedup": round(sync["wall_s"] / asy["wall_s"], 4),
        "generator_busy_async": round(asy["generator_busy"], 4),
        "generator_busy_sync": round(sync["generator_busy"], 4),
    }
    for r in (sync, asy):
        m = r["mode"]
        out.update(
            {
                f"wall_s_{m}": round(r["wall_s"], 3),
                f"client_busy_{m}": round(r["client_busy"], 4),
                f"slot_occupancy_{m}": round(r["slot_occupancy"], 4),
                f"generated_tokens_per_s_{m}": round(r["generated_tokens_per_s"], 1),
                f"staleness_mean_{m}": round(r["staleness_mean"], 4),
                f"trained_sequences_{m}": int(r["trained_sequences"]),
                f"dropped_groups_{m}": int(r["dropped_groups"]),
                f"stale_groups_{m}": int(r["stale_groups"]),
            }
        )
    out.update(
        {
            "steps": args.steps,
            "servers": args.servers,
            "slots": args.slots,
            "group_size": args.group_size,
            "n_batch": args.n_batch,
            "n_async": args.n_async,
            "l_max": args.l_max,
        }
    )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--real",
        action="store_true",
        help="real tiny model, PolicyTrainer and WeightBroadcaster (slow on 2 cores)",
    )
    ap.add_argument("--steps", type=int, help="training steps per loop mode (6; --real: 2)")
    ap.add_argument("--servers", type=int, default=2, help="engine servers")
    ap.add_argument("--slots", type=int, help="sequences per server (32; --real: 16)")
    ap.add_argument("--group-size", type=int, help="G (8; --real: 4)")
    ap.add_argument("--n-batch", type=int, help="sequences per step (64; --real: 16)")
    ap.add_argument("--n-async", type=int, help="sequences in flight (128; --real: 32)")
    ap.add_argument("--l-max", type=int, help="completion token limit (512; --real: 96)")
    ap.add_argument("--median-len", type=float, help="median completion length (64; --real: 24)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    ap.add_argument("--p-correct", type=float, default=0.5, help="share of correct completions")
    ap.add_argument("--script", type=int, default=1024, help="completions in the script")
    ap.add_argument("--problems", type=int, default=256, help="prompt variants")
    ap.add_argument("--decode-ms", type=float, default=10.0, help="engine step, fixed part")
    ap.add_argument("--decode-ms-per-seq", type=float, default=0.05, help="per running sequence")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.005, help="per prompt token")
    ap.add_argument(
        "--train-ms-per-token", type=float, default=0.1, help="modeled trainer: milliseconds per batch token"
    )
    ap.add_argument("--sync-ms", type=float, default=50.0, help="modeled weight transfer (paused)")
    ap.add_argument("--workers", type=int, default=1, help="verifier processes")
    ap.add_argument("--sft-steps", type=int, default=60, help="--real: SFT steps on the script")
    ap.add_argument("--lr", type=float, default=1e-5, help="--real: RL learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed afterwards)")
    args = ap.parse_args(argv)
    defaults = dict(
        steps=(6, 2),
        slots=(32, 16),
        group_size=(8, 4),
        n_batch=(64, 16),
        n_async=(128, 32),
        l_max=(512, 96),
        median_len=(64.0, 24.0),
    )
    for name, (timing, real) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, real if args.real else timing)
    args.max_len = args.l_max + 64  # prompt (~40 tokens) + completion per slot
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-async-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        out = run(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
