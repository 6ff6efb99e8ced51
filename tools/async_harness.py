"""The machinery of ``megatron-rl bench async`` (``tools/bench_async.py``), shared with
``megatron-rl bench scale`` (``tools/bench_scale.py``): one loop mode run on a workload, from the
files to the figures.

- the workload: the "2 + 2" problems, the tokenizer, the random tiny model's folder and the script
  of long-tailed completions (:func:`build_workload`), and the timing model's JSON for the
  servers (:func:`write_timing`);
- the engine servers, started and tracked by PID (:func:`start_servers`);
- the timing model's stand-ins: :class:`ModeledTrainer` (sleeps the cost model's optimizer step)
  and :class:`VersionBroadcaster` (a weight update with no weights, as ``weight_sync.pause_mode``
  makes it); ``--real``'s parts instead: the SFT on the script (:func:`sft_on_script`) and the real
  trainer and broadcaster (:class:`RealParts`);
- one loop mode (:func:`run_mode`): the run's config (:func:`run_config`), the real orchestrator
  over the fleet and the verifier pool for ``--steps`` steps, and its figures (wall, busy
  fractions, slot occupancy, orchestrator CPU) from the servers' own accounting;
- the ideal schedule of a mode on the same workload and costs (:func:`ideal`,
  ``tools/async_model.py``), and the command-line options both benches share.

What the figures mean, and why the bench is built this way, is in ``tools/bench_async.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import socket
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# The cost model sits next to this file; ``megatron-rl bench`` runs the programs with runpy, which
# does not put the file's folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_model import Costs, ideal_schedule

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
    lengths: list[int]  # completion tokens per script entry as generated (after the l_max cut)
    prompts: dict[str, list[int]]  # problem id -> rendered prompt ids, as Rollouts renders them


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
    """Problems, tokenizer, the random tiny model's folder and the completion script."""
    from megatron_rl.data.problems import Problem
    from megatron_rl.data.sampling import render_prompt
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
    prompts = {
        p.id: render_prompt(tok, p.problem, p.task, system_prompt=QUICKSTART_SYSTEM_PROMPT) for p in problems
    }
    return Workload(problems, tok, tok_dir, init, script, lengths, prompts)


def write_timing(w: Workload, costs: Costs, root: Path) -> Path:
    """The timing model's JSON for the servers: the calibrated engine costs and the script."""
    path = root / "timing.json"
    timing = {
        "decode_s": costs.decode_s,
        "decode_s_per_seq": costs.decode_s_per_seq,
        "prefill_s_per_token": costs.prefill_s_per_token,
        "script": w.script,
    }
    path.write_text(json.dumps(timing))
    return path


# ---------------------------------------------------------------------- stand-ins (default mode)


class ModeledTrainer:
    """A trainer whose optimizer step takes ``(train_s + train_s_per_token * tokens) / speedup``
    seconds, ``tokens`` the batch's (prompt + completion): the measured trainer's cost, run on
    ``speedup`` data-parallel replicas."""

    def __init__(self, train_s: float, train_s_per_token: float, speedup: float = 1.0):
        self.train_s, self.s_per_token, self.speedup = train_s, train_s_per_token, speedup
        self.step = 0

    def rl_step(self, batch) -> dict[str, float]:
        tokens = sum(batch.lengths)
        seconds = (self.train_s + self.s_per_token * tokens) / self.speedup
        time.sleep(seconds)
        self.step += 1
        return {"step_time_s": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}


def _post(url: str, route: str, body: dict, api_key: str) -> dict:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


class VersionBroadcaster:
    """A weight update with no weights, as ``weight_sync.pause_mode`` makes it:

    - ``none`` (the built-in engine's streamed update, the default there): the servers decode
      while ``hold_s`` (the transfer) passes, then each swaps in the new version between two
      engine steps (``/update_weight_version``, requests kept);
    - ``in_place`` (SGLang's per-bucket update): pause in place, set the version on every server
      while ``hold_s`` passes, resume. The version goes out during the hold, not after it: a real
      update sets it with the weights (SGLang's ``weight_version`` in the update call), so the
      paused fleet waits for the slower of the two, not for both.

    Running requests keep going either way; later tokens carry the new version."""

    def __init__(self, fleet, api_key: str, hold_s: float = 0.0, pause_mode: str = "none"):
        self.fleet, self.api_key, self.hold_s, self.pause_mode = fleet, api_key, hold_s, pause_mode
        self._calls = ThreadPoolExecutor(len(fleet.update_urls), thread_name_prefix="bench-version")

    def _set_version(self, version: int) -> list:
        body = {"new_version": str(version), "abort_all_requests": False}
        return [  # every server at once, as a broadcast
            self._calls.submit(_post, u, "/update_weight_version", body, self.api_key)
            for u in self.fleet.update_urls
        ]

    def sync(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.pause_mode == "none":
            time.sleep(self.hold_s)  # received on the servers' own threads while they decode
            for c in self._set_version(version):
                c.result()
        else:
            self.fleet.pause(self.pause_mode)
            try:
                calls = self._set_version(version)
                time.sleep(self.hold_s)
                for c in calls:
                    c.result()
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
    """The run's config for loop ``mode``: the bench's loop, reward and GRPO settings."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.orchestration.config import FleetConfig, LoopConfig
    from megatron_rl.orchestration.recipe import RunConfig
    from megatron_rl.rewards.compose import RewardConfig

    return RunConfig(
        loop=LoopConfig(
            mode=mode,
            group_size=args.group_size,
            n_batch=args.n_batch,
            n_async=args.n_async,
            max_steps=args.steps,
            max_staleness=args.max_staleness,
            seed=args.seed,
        ),
        reward=RewardConfig(l_max=args.l_max, l_cache=args.l_max // 4, workers=args.workers),
        algorithm=GRPOConfig(),
        fleet=FleetConfig(group_requests={"auto": "auto", "on": True, "off": False}[args.group_requests]),
    )


def add_pause_mode_arg(ap: argparse.ArgumentParser, default: str) -> None:
    """``--pause-mode none|in_place`` (``weight_sync.pause_mode``), shared with bench scale."""
    ap.add_argument(
        "--pause-mode",
        choices=("none", "in_place"),
        default=default,
        help="the fleet during a weight update (weight_sync.pause_mode): none, the built-in engine's "
        "streamed update (decodes while it receives, swaps between two steps); in_place, SGLang's "
        f"(paused for the transfer). Default: {default}",
    )


def add_group_requests_arg(ap: argparse.ArgumentParser) -> None:
    """``--group-requests auto|on|off`` (``fleet.group_requests``), shared with bench scale."""
    ap.add_argument(
        "--group-requests",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="fleet.group_requests: a group's samples in one /generate (on), one request each "
        "(off); auto (default): per group, as the built-in engine streams them back one by one",
    )


def _server_stats(fleet) -> list[dict]:
    return [fleet.server_info(s.url)["internal_states"][0] for s in fleet.servers]


def run_mode(mode: str, w: Workload, fleet, pool, args: argparse.Namespace, parts, api_key: str) -> dict:
    """``args.steps`` steps of the loop in ``mode`` from version 0; wall time and busy figures.
    ``parts``: :class:`RealParts`, or the :class:`Costs` and fleet sizing of the timing model."""
    from megatron_rl.orchestration.loop import Orchestrator
    from megatron_rl.orchestration.rollouts import Rollouts
    from megatron_rl.orchestration.sampler import PromptSampler
    from megatron_rl.quickstart.tokenizer import QUICKSTART_SYSTEM_PROMPT

    cfg = run_config(mode, args)
    if isinstance(parts, RealParts):
        parts.reset()
        trainer, broadcaster = parts.trainer, parts.broadcaster
    else:
        costs, sizing = parts
        trainer = ModeledTrainer(costs.train_s, costs.train_s_per_token, sizing["train_speedup"])
        broadcaster = VersionBroadcaster(fleet, api_key, args.sync_ms / 1e3, args.pause_mode)
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
    cpu0 = _cpu_s()
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
                f"(max {m.get('length/max', 0):.0f}), dropped {m['groups/dropped']:.0f}, "
                f"queue blocked {m['queue/blocked_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        wall = time.monotonic() - t0
        cpu = _cpu_s() - cpu0
        after = _server_stats(fleet)
    finally:
        orch.stop()
        fleet.abort()  # async leaves requests in flight: end them before the next mode
        _drain(rollouts)
    return _summary(mode, wall, cpu, before, after, metrics, args)


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread (the orchestrator: loop, fleet client,
    pool dispatcher; not the verifier workers or the servers, which are other processes)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _drain(rollouts, timeout_s: float = 30.0) -> None:
    rollouts.wait_until(lambda: rollouts.in_flight == 0, timeout=timeout_s)


def _summary(
    mode: str,
    wall: float,
    cpu: float,
    before: list[dict],
    after: list[dict],
    metrics: list[dict],
    args: argparse.Namespace,
) -> dict:
    servers = len(before)
    delta = {
        k: sum(a[k] - b[k] for a, b in zip(after, before))
        for k in (
            "busy_s",
            "paused_s",
            "steps",
            "generated_tokens",
            "prefill_tokens",
            "completions",
            "connections",
        )
    }
    updates = sum(1 for m in metrics if "weight_sync/seconds" in m)
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in metrics)
    return {
        "mode": mode,
        "wall_s": wall,
        "steps": len(metrics),
        "generator_busy": min(1.0, delta["busy_s"] / (wall * servers)),
        # The orchestrator process's CPU over the wall: one Python process saturates near 1.0.
        "client_busy": cpu / wall,
        "client_cpu_s": cpu,
        "completions": delta["completions"],
        "in_flight_fraction": mean("generator/busy_fraction"),
        "slot_occupancy": delta["generated_tokens"] / max(1, delta["steps"] * args.slots),
        "generated_tokens_per_s": delta["generated_tokens"] / wall,
        "trained_sequences": sum(m.get("sequences", 0.0) for m in metrics),
        "train_s": sum(m.get("time/train_s", 0.0) for m in metrics),
        "length_mean": mean("length/mean"),
        "staleness_mean": mean("staleness/mean"),
        "dropped_groups": sum(m.get("groups/dropped", 0.0) for m in metrics),
        "stale_groups": sum(m.get("groups/dropped/stale", 0.0) for m in metrics),
        "queue_blocked_s": metrics[-1].get("queue/blocked_s", 0.0) if metrics else 0.0,
        "engine_steps": delta["steps"],
        "prefill_tokens": delta["prefill_tokens"],
        "weight_update_ms": 1e3 * mean("weight_sync/seconds"),
        # The servers' own count: paused from /pause_generation landing to /continue_generation's.
        "paused_ms_per_update": 1e3 * delta["paused_s"] / max(1, servers * updates),
        "connections": delta["connections"],  # TCP connections the servers accepted
        "weight_update_ms_max": 1e3 * max((m.get("weight_sync/seconds", 0.0) for m in metrics), default=0.0),
        "step_s": [m.get("time/step_s", 0.0) for m in metrics],
    }


# ---------------------------------------------------------------------- the ideal of this run


def ideal(mode: str, w: Workload, costs: Costs, sizing: dict[str, float], args: argparse.Namespace) -> dict:
    """The ideal schedule of ``mode`` for this run's workload, cost model and fleet."""
    return ideal_schedule(
        run_config(mode, args), w.problems, w.tokenizer, w.script, w.lengths, w.prompts, costs, sizing, args
    )


# ---------------------------------------------------------------------- the run


def start_servers(
    folder: Path, root: Path, args: argparse.Namespace, api_key: str, timing: Path | None
) -> list:
    """``args.servers`` engine processes (tracked by PID, stopped by us), wanting ``api_key``.
    Started from this thread: a server dies with the *thread* that started it
    (``PR_SET_PDEATHSIG``), so a short-lived starter thread would take it down on exit."""
    from megatron_rl.generation.engine.launch import EngineProcess

    extra = [] if timing is None else ["--timing-model", str(timing)]
    procs = []
    try:
        for i in range(args.servers):  # launched side by side, then waited for
            procs.append(
                EngineProcess(
                    folder,
                    max_slots=args.slots,
                    max_len=args.max_len,
                    threads=1,
                    log_path=root / f"engine-{i}.log",
                    extra_args=extra,
                    api_key=api_key,
                ).launch()
            )
        for p in procs:
            p.wait_ready(timeout_s=120.0 + 2.0 * args.servers)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs
