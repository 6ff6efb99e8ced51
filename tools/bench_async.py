"""Asynchronous against synchronous GRPO loop on a long-tailed completion-length workload, on a
cost model calibrated on this machine.

    megatron-rl bench async [--steps 12] [--servers 4] [--slots 32] [--train-share 0.75]
    megatron-rl bench async --real [--steps 4]      # the tiny model, trainer and weight sync
    megatron-rl bench async --async-only [...]      # the async loop alone: its own figures

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

- the servers run ``--timing-model`` (``generation/engine/timing.py``): a step takes
  ``decode_s + decode_s_per_seq * batch + prefill_s_per_token * distinct prompt tokens admitted``
  and writes the tokens of a script (the completion a request's sampling seed picks);
- the trainer sleeps ``(train_s + train_s_per_token * tokens) / train_speedup`` per optimizer
  step; its weight update holds ``--sync-ms`` (the transfer) and sets the servers' weight version
  (``/update_weight_version``, requests kept), as ``weight_sync.pause_mode`` makes it
  (``--pause-mode``): ``none``, the built-in engine's streamed update, decodes through the
  transfer and swaps between two engine steps (a GPU receives on a CUDA stream of its own; the
  model charges the decode nothing for it); ``in_place``, SGLang's, pauses the fleet for it.

**Calibration.** The costs are measured at the start of the run, warm, medians of repeats (the
cores are shared, so the figures move from run to run; they are printed with the result): the
real :class:`~megatron_rl.generation.engine.Engine` on the tiny model with one thread, as a
server runs it -- decode step time at several running batches, fitted by least squares to
``decode_s + decode_s_per_seq * batch``, and the prefill of one group's prompt per prompt token;
the real ``PolicyTrainer`` -- GRPO steps on batches of two sizes, fitted to ``train_s +
train_s_per_token * tokens``. A cost given on the command line is used as given instead.

**Fleet size.** As in the paper the fleet holds ``n_async`` sequences at once (``n_async /
n_batch`` = 2): ``--servers`` defaults to ``n_async / --slots`` (4 servers x 32 slots for the one
trainer). On this machine the tiny trainer costs several times more per trained token than the
engine per generated token, so one measured trainer against that fleet is trainer-bound, the
opposite of the paper's runs, where generation dominates the wall time and the bounded queue
only throttles generators early in training. The bench therefore models a trainer
``train_speedup`` times the measured one (``train_speedup`` data-parallel replicas of it; the
table prints the resulting generator servers per measured trainer), chosen from the calibrated
costs so that training a batch takes ``--train-share`` (0.75) of the time the fleet needs to
generate it at full slots: generation dominates, and the trainer keeps up with room to spare.
``--train-speedup`` sets it directly. The figures depend on this choice and on the measured cost
shape: the more of a CPU decode step grows with its batch (``decode_s_per_seq``), the cheaper a
sync step's nearly empty tail and the less async gains.

**Staleness.** With ``loop.max_staleness: N`` the loop drops groups whose oldest token is more
than N versions old; the default sets no bound, as the paper. Here a step is short next to the
longest completions, so a bound of ``2 n_async / n_batch`` (= 4) would drop the long tail in
async and re-issue it with the same seeds (so the same lengths, often dropped again): the two
loops would no longer train the same completions. The bench runs the default and reports what
that bound would cost in the ideal schedule (``ideal_async_speedup_loop_bound``).

**Ideal.** :class:`IdealSchedule` (``tools/async_model.py``) simulates both loops' schedules event by event on the same cost
model with zero overhead (requests, results and groups arrive the instant they are sent; scoring
takes no time), with the loop's rules: ``async_efficiency`` = ideal async wall / measured async
wall (<= 1: what the real threads, HTTP, verifiers and the sleeping servers cost), and the ideal
speed-up is what the schedule itself allows. The table says what limits it: the sync loop's
generators idle on stragglers and during training, the async loop is generator- or trainer-bound.

``--real`` runs the real tiny model in the servers, a real ``PolicyTrainer`` and the real
``WeightBroadcaster`` instead (after a short SFT on the script, so that the model writes the
format with long-tailed lengths and mixed answers) and reports ``async_speedup_real``; on 2
shared cores the engines, the trainer and everything else fight for the cores, so the figure is
noisy and says little about scheduling.

**Workload.** Problems are ``--problems`` variants of "What is 2 + 2?" (answer 4). The script
holds ``--script`` completions ``<think> filler </think>The answer is \\boxed{4}.`` (or
``\\boxed{5}``, wrong, with probability ``1 - --p-correct``) plus EOS, whose lengths are lognormal
(median ``--median-len``, log-space sigma ``--sigma``, as the paper's long tail); lengths beyond
``--l-max`` are cut by ``max_new_tokens`` and fail the format check (reward 0). Rewards within a
group differ (correctness, the length penalty), so groups are kept and long ones stall a sync
step. ``n_async / n_batch`` = 2, the paper's bound.

**Figures.** ``generator_busy_<mode>``: the servers' own accounting, the sum of their engine step
times over the mode's wall time and the number of servers (``/server_info``
``internal_states.busy_s``); ``client_busy_<mode>``: the orchestrator process's CPU seconds (every
thread: loop, fleet client, pool dispatcher; not the verifier workers or the servers) over the
mode's wall time -- one Python process saturates near 1.0 -- and
``client_cpu_ms_per_completion_<mode>`` the same CPU per completion the servers returned;
``--group-requests on|off|auto`` sends a group's samples in one request or one each (``fleet.group_requests``; auto: per group, the built-in engine streams them); ``slot_occupancy_<mode>``: generated tokens per
engine step over the slots (a sync step's tail runs steps with a nearly empty batch; tokens are
counted when their request finishes). The last line is one JSON object.

The machinery (workload, servers, stand-ins, one loop mode and its figures) is in
``tools/async_harness.py``, shared with ``megatron-rl bench scale``; the cost model, its
calibration and the ideal schedule are in ``tools/async_model.py``. This program runs them, prints
the table and says what limits the figures.

Time: ~2.5-3 min with the defaults on 2 shared cores (~40 s calibration, ~1 min the sync loop);
``--real`` ~2.5 min, most of it the SFT.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

# The cost model and the harness sit next to this file; ``megatron-rl bench`` runs it with runpy,
# which does not put the file's folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_harness import (
    RealParts,
    Workload,
    add_group_requests_arg,
    add_pause_mode_arg,
    build_workload,
    ideal,
    run_config,
    run_mode,
    sft_on_script,
    start_servers,
    write_timing,
)
from async_model import Costs, calibrate, size_fleet

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, run_cli

# ---------------------------------------------------------------------- the run


def run(args: argparse.Namespace, root: Path) -> dict:
    """Calibrate (timing model), start the servers, run both loop modes; the report."""
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.rewards.pool import VerifierPool

    w = build_workload(root, args)
    costs = sizing = timing = None
    if args.real:
        folder = sft_on_script(w, root, args)
    else:
        prompts = list(w.prompts.values())
        folder, costs = w.init, calibrate(w.init, prompts, w.script, args)
        sizing = size_fleet(costs, w.lengths, prompts, args)
        timing = write_timing(w, costs, root)
    api_key = secrets.token_urlsafe(32)  # our servers are never open, not even on loopback
    procs = start_servers(folder, root, args, api_key, timing)
    fleet = real = None
    try:
        fleet = FleetClient([p.url for p in procs], api_key=api_key)
        real = RealParts(folder, fleet, run_config("sync", args), args) if args.real else None
        parts = real if real is not None else (costs, sizing)
        modes = ("async",) if args.async_only else ("sync", "async")
        with VerifierPool(args.workers) as pool:
            results = {mode: run_mode(mode, w, fleet, pool, args, parts, api_key) for mode in modes}
    finally:
        if real is not None:
            real.close()
        if fleet is not None:
            fleet.close()
        for p in procs:
            p.stop()
    if args.async_only:  # no speed-up without the sync loop: the async loop's own figures
        out: dict = {"mode": "real" if args.real else "timing-model", "loop_modes": "async"}
        _mode_figures(results["async"], out)
        print(
            f"async loop alone: {out['wall_s_async']:.2f} s, orchestrator CPU "
            f"{out['client_busy_async']:.2f} of a core, {out['client_cpu_ms_per_completion_async']:.3f} ms "
            f"per completion, slots {out['slot_occupancy_async']:.2f} full"
        )
        return out
    if costs is None or sizing is None:
        return report_real(results, w, args)
    ideals = {mode: ideal(mode, w, costs, sizing, args) for mode in ("sync", "async")}
    if args.max_staleness == -1:  # what a staleness bound of 2 n_async / n_batch would cost
        bound = 2 * -(-run_config("async", args).loop.async_cap() // args.n_batch)
        ideals["async_bound"] = ideal(
            "async", w, costs, sizing, argparse.Namespace(**{**vars(args), "max_staleness": bound})
        )
    return report(results, ideals, costs, sizing, w, args)


def _workload_line(w: Workload, args: argparse.Namespace) -> str:
    lengths = sorted(w.lengths)
    cut = sum(n >= args.l_max for n in lengths) / len(lengths)
    return (
        f"workload: lognormal completion lengths (sigma {args.sigma}), median "
        f"{statistics.median(lengths):.0f}, mean {statistics.fmean(lengths):.0f}, p95 "
        f"{lengths[int(0.95 * (len(lengths) - 1))]}, {100 * cut:.1f}% cut at l_max={args.l_max}; "
        f"G={args.group_size}, n_batch={args.n_batch}, n_async={args.n_async} "
        f"(n_async/n_batch={args.n_async / args.n_batch:g}), {args.steps} steps per loop mode"
    )


def _mode_figures(r: dict, out: dict) -> None:
    m = r["mode"]
    out.update(
        {
            f"wall_s_{m}": round(r["wall_s"], 3),
            f"client_busy_{m}": round(r["client_busy"], 4),
            # Orchestrator CPU per completion the servers returned: what sizes one orchestrator's fleet.
            f"client_cpu_ms_per_completion_{m}": round(1e3 * r["client_cpu_s"] / max(1, r["completions"]), 4),
            f"slot_occupancy_{m}": round(r["slot_occupancy"], 4),
            f"generated_tokens_per_s_{m}": round(r["generated_tokens_per_s"], 1),
            f"staleness_mean_{m}": round(r["staleness_mean"], 4),
            f"trained_sequences_{m}": int(r["trained_sequences"]),
            f"dropped_groups_{m}": int(r["dropped_groups"]),
            f"stale_groups_{m}": int(r["stale_groups"]),
            f"weight_update_ms_{m}": round(r["weight_update_ms"], 2),
            f"paused_ms_per_update_{m}": round(r["paused_ms_per_update"], 2),
            f"connections_{m}": int(r["connections"]),
        }
    )


def _limits(
    ideals: dict[str, dict],
    sizing: dict[str, float],
    results: dict[str, dict],
    sync_ms: float,
    pause_mode: str,
) -> list[str]:
    """What bounds the speed-up and the efficiency, in the ideal's and the run's own figures."""
    si, ai = ideals["sync"], ideals["async"]
    out = [
        f"sync (ideal): generators busy {si['generator_busy']:.2f} of the wall; the trainer "
        f"{si['trainer_busy']:.2f} (the fleet idles while it trains); slots {si['slot_occupancy']:.2f} "
        "full while decoding (a step waits for its longest completion: the stragglers)",
    ]
    if ai["trainer_busy"] > 0.9:
        bound = "trainer-bound: the queue fills and the generators wait on the trainer"
    else:
        bound = "generator-bound: the trainer waits for batches, as in the paper"
    out.append(
        f"async (ideal): generators busy {ai['generator_busy']:.2f}, trainer {ai['trainer_busy']:.2f}: "
        f"{bound}; slots {ai['slot_occupancy']:.2f} full; "
        + (
            "the weight updates pause the fleet"
            if pause_mode != "none"
            else "the fleet decodes through the weight updates (swapped between two steps)"
        )
    )
    bound = ideals.get("async_bound")
    if bound is not None and bound["stale"] > 0:
        out.append(
            "with a staleness bound of 2 n_async/n_batch (loop.max_staleness; the default sets none) "
            f"the ideal async loop drops "
            f"{bound['stale']:.0f} of {bound['issued']:.0f} groups as stale -- the longest completions "
            "span more versions than the bound -- and re-issues them with the same seeds; its wall "
            f"would be {bound['wall_s']:.2f} s (speed-up {si['wall_s'] / bound['wall_s']:.2f}), and it "
            "trains fewer long completions than the sync loop, so the bench turns the bound off"
        )
    ra = results["async"]
    first, rest = ra["step_s"][0], statistics.fmean(ra["step_s"][1:] or [0.0])
    out.append(
        f"async (measured): {ra['wall_s'] - ai['wall_s']:+.2f} s over the ideal -- first step "
        f"{first:.2f} s (ideal {ai['step_s'][0]:.2f}: n_async requests sent at once over HTTP), then "
        f"{rest:.2f} s a step (ideal {statistics.fmean(ai['step_s'][1:] or [0.0]):.2f}); engine steps "
        f"{ra['engine_steps']:.0f} (ideal {ai['engine_steps']:.0f}), prompt tokens prefilled "
        f"{ra['prefill_tokens']:.0f} (ideal {ai['prefill_tokens']:.0f}: a group's samples that reach a "
        f"server in different steps are prefilled apart); queue full {ra['queue_blocked_s']:.2f} s; "
        f"a weight update {ra['weight_update_ms']:.0f} ms (ideal {sync_ms:g}), the fleet paused "
        f"{ra['paused_ms_per_update']:.1f} ms of it per server ({pause_mode}). "
        "The rest is what HTTP, the verifier pool, the loop's threads and the sleeping servers cost "
        "on the shared cores"
    )
    return out


def report(
    results: dict[str, dict],
    ideals: dict[str, dict],
    costs: Costs,
    sizing: dict[str, float],
    w: Workload,
    args: argparse.Namespace,
) -> dict:
    """Print the cost model, the fleet, the table and its limits; the figures as one dict."""
    sync, asy = results["sync"], results["async"]
    src = lambda n: "given" if n in costs.given else "measured"
    print(
        "mode: timing-model (engine servers sleep a cost model calibrated on this machine, the "
        f"trainer sleeps per token); {args.servers} servers x {args.slots} slots"
    )
    print(
        f"cost model: decode {1e3 * costs.decode_s:.3f} ms + {1e3 * costs.decode_s_per_seq:.4f} ms per "
        f"running sequence ({src('decode_s')}; points (batch, ms): {costs.measured.get('decode_points', '-')}), "
        f"prefill {1e3 * costs.prefill_s_per_token:.4f} ms per distinct prompt token "
        f"({src('prefill_s_per_token')}), trainer {1e3 * costs.train_s:.1f} ms + "
        f"{1e3 * costs.train_s_per_token:.4f} ms per trained token ({src('train_s_per_token')}; "
        f"points (tokens, s): {costs.measured.get('train_points', '-')}), weight update {args.sync_ms:g} ms (modeled)"
    )
    print(
        f"fleet: a batch takes the fleet {sizing['gen_batch_s']:.2f} s to generate at full slots and "
        f"this machine's trainer {sizing['train_batch_s_measured']:.2f} s to train; the modeled trainer is "
        f"{sizing['train_speedup']:.2f}x it ({sizing['train_batch_s']:.2f} s a batch, train share "
        f"{sizing['train_batch_s'] / sizing['gen_batch_s']:.2f}): {sizing['servers_per_trainer']:.3f} "
        "generator servers per measured trainer, generation dominating as in the paper (the figures "
        "depend on this choice: --train-share, --train-speedup)"
    )
    print(_workload_line(w, args))
    print(
        f"{'loop':6} {'wall s':>7} {'ideal s':>8} {'ideal/wall':>10} {'÷ sync':>7} {'gen busy':>9} "
        f"{'ideal busy':>10} {'client busy':>12} {'slot occ':>9} {'stale':>6}"
    )
    for r in (sync, asy):
        i = ideals[r["mode"]]
        print(
            f"{r['mode']:6} {r['wall_s']:7.2f} {i['wall_s']:8.2f} {i['wall_s'] / r['wall_s']:10.2f} "
            f"{r['wall_s'] / sync['wall_s']:7.2f} {r['generator_busy']:9.2f} {i['generator_busy']:10.2f} "
            f"{r['client_busy']:12.2f} {r['slot_occupancy']:9.2f} {r['staleness_mean']:6.2f}"
        )
    ideal_speedup = ideals["sync"]["wall_s"] / ideals["async"]["wall_s"]
    print(
        f"async speed-up {sync['wall_s'] / asy['wall_s']:.2f} (ideal {ideal_speedup:.2f}); "
        f"async efficiency {ideals['async']['wall_s'] / asy['wall_s']:.2f}"
    )
    for line in _limits(ideals, sizing, results, args.sync_ms, args.pause_mode):
        print("  " + line)
    out = {
        "mode": "timing-model",
        "async_speedup": round(sync["wall_s"] / asy["wall_s"], 4),
        "async_efficiency": round(ideals["async"]["wall_s"] / asy["wall_s"], 4),
        "generator_busy_async": round(asy["generator_busy"], 4),
        "generator_busy_sync": round(sync["generator_busy"], 4),
        "ideal_async_speedup": round(ideal_speedup, 4),
        "ideal_wall_s_sync": round(ideals["sync"]["wall_s"], 3),
        "ideal_wall_s_async": round(ideals["async"]["wall_s"], 3),
        "sync_efficiency": round(ideals["sync"]["wall_s"] / sync["wall_s"], 4),
        "ideal_generator_busy_sync": round(ideals["sync"]["generator_busy"], 4),
        "ideal_generator_busy_async": round(ideals["async"]["generator_busy"], 4),
        "ideal_trainer_busy_async": round(ideals["async"]["trainer_busy"], 4),
    }
    if "async_bound" in ideals:
        out["ideal_stale_groups_loop_bound"] = int(ideals["async_bound"]["stale"])
        out["ideal_async_speedup_loop_bound"] = round(
            ideals["sync"]["wall_s"] / ideals["async_bound"]["wall_s"], 4
        )
    for r in (sync, asy):
        _mode_figures(r, out)
    out.update(
        {
            "decode_ms": round(1e3 * costs.decode_s, 4),
            "decode_ms_per_seq": round(1e3 * costs.decode_s_per_seq, 5),
            "prefill_ms_per_token": round(1e3 * costs.prefill_s_per_token, 5),
            "train_ms": round(1e3 * costs.train_s, 3),
            "train_ms_per_token": round(1e3 * costs.train_s_per_token, 5),
            "calibrated": [
                n
                for n in (
                    "decode_s",
                    "decode_s_per_seq",
                    "prefill_s_per_token",
                    "train_s",
                    "train_s_per_token",
                )
                if n not in costs.given
            ],
            "train_speedup": round(sizing["train_speedup"], 3),
            "servers_per_trainer": round(sizing["servers_per_trainer"], 4),
            "sync_ms": args.sync_ms,
            "pause_mode": args.pause_mode,
            **_run_shape(args),
        }
    )
    return out


def _run_shape(args: argparse.Namespace) -> dict:
    keys = ("steps", "servers", "slots", "group_size", "n_batch", "n_async", "l_max")
    return {k: getattr(args, k) for k in keys}


def report_real(results: dict[str, dict], w: Workload, args: argparse.Namespace) -> dict:
    """Print the real mode's table; its figures as one dict."""
    sync, asy = results["sync"], results["async"]
    print(
        f"mode: real (tiny model in {args.servers} engine servers x {args.slots} slots, PolicyTrainer, "
        "WeightBroadcaster); 2 shared cores run everything, so this figure is noisy"
    )
    print(_workload_line(w, args))
    print(f"{'loop':6} {'wall s':>7} {'s/step':>7} {'÷ sync':>7} {'gen busy':>9} {'train s':>8} {'stale':>6}")
    for r in (sync, asy):
        print(
            f"{r['mode']:6} {r['wall_s']:7.2f} {r['wall_s'] / r['steps']:7.2f} {r['wall_s'] / sync['wall_s']:7.2f} "
            f"{r['generator_busy']:9.2f} {r['train_s']:8.2f} {r['staleness_mean']:6.2f}"
        )
    print(
        f"steps: {args.steps} per loop mode; training took {sync['train_s'] / sync['wall_s']:.2f} of the "
        f"sync wall and {asy['train_s'] / asy['wall_s']:.2f} of the async wall: the real tiny trainer "
        "dominates on these cores, so the async loop can hide little generation behind it"
    )
    out = {
        "mode": "real",
        "async_speedup_real": round(sync["wall_s"] / asy["wall_s"], 4),
        "generator_busy_async": round(asy["generator_busy"], 4),
        "generator_busy_sync": round(sync["generator_busy"], 4),
    }
    for r in (sync, asy):
        _mode_figures(r, out)
    out.update(_run_shape(args))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The bench's options, with the defaults of its mode (timing model or ``--real``)."""
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--real",
        action="store_true",
        help="real tiny model, PolicyTrainer and WeightBroadcaster (slow on 2 cores)",
    )
    ap.add_argument(
        "--async-only",
        action="store_true",
        help="run the async loop alone (no sync run, no speed-up): its orchestrator CPU and slot "
        "figures in half the time, for comparing two versions of the code run after run",
    )
    ap.add_argument(
        "--steps",
        type=int_arg(1),
        help="training steps per loop mode (12: the first async step fills the pipeline, a longer run weighs it less; --real: 4)",
    )
    ap.add_argument(
        "--servers",
        type=int_arg(1),
        help="generator (engine) servers for the one trainer (default: n_async / slots, the fleet "
        "holds n_async sequences; --real: 2)",
    )
    ap.add_argument("--slots", type=int_arg(1), help="sequences per server (32; --real: 16)")
    ap.add_argument("--group-size", type=int_arg(1), help="G (8; --real: 4)")
    ap.add_argument("--n-batch", type=int_arg(1), help="sequences per step (64; --real: 16)")
    ap.add_argument("--n-async", type=int_arg(1), help="sequences in flight (2 n_batch)")
    ap.add_argument("--l-max", type=int_arg(1), help="completion token limit (512; --real: 96)")
    ap.add_argument(
        "--median-len", type=float_arg(0.0, low_open=True), help="median completion length (64; --real: 24)"
    )
    ap.add_argument("--sigma", type=float_arg(0.0), default=1.0, help="lognormal sigma of the lengths")
    ap.add_argument("--p-correct", type=float_arg(0.0, 1.0), default=0.5, help="share of correct completions")
    ap.add_argument("--script", type=int_arg(1), default=1024, help="completions in the script")
    ap.add_argument("--problems", type=int_arg(1), default=256, help="prompt variants")
    cost = "(default: measured at the start of the run)"
    ap.add_argument("--decode-ms", type=float_arg(0.0), help=f"engine step, fixed part {cost}")
    ap.add_argument(
        "--decode-ms-per-seq", type=float_arg(0.0), help=f"engine step, per running sequence {cost}"
    )
    ap.add_argument("--prefill-ms-per-token", type=float_arg(0.0), help=f"per distinct prompt token {cost}")
    ap.add_argument("--train-ms", type=float_arg(0.0), help=f"trainer step, fixed part {cost}")
    ap.add_argument("--train-ms-per-token", type=float_arg(0.0), help=f"trainer step, per batch token {cost}")
    ap.add_argument(
        "--train-share",
        type=float_arg(0.0, 1.0, low_open=True),
        default=0.75,
        help="size the modeled trainer so that training a batch takes this share of the fleet's "
        "time to generate it (generation dominates, as in the paper)",
    )
    ap.add_argument(
        "--train-speedup",
        type=float_arg(0.0, low_open=True),
        help="the modeled trainer is this many times the measured one (data-parallel replicas); "
        "servers / this = generator servers per measured trainer (default: from --train-share)",
    )
    ap.add_argument(
        "--max-staleness",
        type=int_arg(-1, note=" (-1: never)"),
        default=-1,
        help="loop.max_staleness: drop groups this many versions old (default -1, the loop's: "
        "never, so that both loops train the same completions)",
    )
    ap.add_argument("--sync-ms", type=float_arg(0.0), default=10.0, help="modeled weight transfer")
    add_pause_mode_arg(ap, "none")
    ap.add_argument(
        "--calib-rounds", type=int_arg(1), default=3, help="repeats of each calibration measurement"
    )
    ap.add_argument("--workers", type=int_arg(1), default=1, help="verifier processes")
    ap.add_argument("--sft-steps", type=int_arg(1), default=60, help="--real: SFT steps on the script")
    ap.add_argument("--lr", type=float_arg(0.0, low_open=True), default=1e-5, help="--real: RL learning rate")
    add_group_requests_arg(ap)
    ap.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed afterwards)")
    args = ap.parse_args(argv)
    defaults = dict(
        steps=(12, 4),
        slots=(32, 16),
        group_size=(8, 4),
        n_batch=(64, 16),
        l_max=(512, 96),
        median_len=(64.0, 24.0),
    )
    for name, (timing, real) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, real if args.real else timing)
    if args.n_async is None:
        args.n_async = 2 * args.n_batch
    if args.servers is None:
        args.servers = 2 if args.real else -(-args.n_async // args.slots)
    for name in ("steps", "servers", "slots", "group_size", "n_batch", "n_async", "l_max", "calib_rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if not args.train_share > 0:
        ap.error(f"--train-share: must be > 0, got {args.train_share}")
    if args.train_speedup is not None and not args.train_speedup > 0:
        ap.error(f"--train-speedup: must be > 0, got {args.train_speedup}")
    args.max_len = args.l_max + 64  # prompt (~40 tokens) + completion per slot
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the bench; print the table and, last, the figures as one JSON line."""
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


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench async", main))
