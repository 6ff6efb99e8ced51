"""``megatron-rl train RECIPE.yaml [key=value ...]``: a whole run, set up, resumed and cleaned up.

On one machine the command starts everything itself: ``fleet.local_servers`` built-in engine
servers (child processes tracked by PID, in their own sessions, dying with the run), the verifier
pool, and the trainer in this process. Under ``torchrun`` every rank runs this; rank 0
orchestrates and talks to the fleet (``fleet.urls``: SGLang servers or a router).

The run directory (``run.dir``)::

    config.yaml        the resolved recipe (a snapshot; a resumed run checks it is compatible)
    metrics.jsonl      one object per step (reward parts, pass rate, lengths, entropy, clip
                       fractions, groups dropped and why, staleness, queue, throughput, sync)
    samples.jsonl      every trained or dropped completion with its reward (data/rundir.py schema)
    ledger.jsonl       per group: trained at step k, or dropped and why (prompt accounting)
    eval.jsonl         held-out pass@1 before RL, every run.eval_every steps, and after; samples
                       per reason, and whether the time limit cut it short (evaluation/heldout.py)
    checkpoints/       trainer state + sampler cursor + prompts in flight + curriculum stage
    plots/             reward, length, entropy ... vs step (PNG)
    logs/              engine server logs
    summary.json       pass@1 before/after, steps, why it stopped, wall time, the samples per
                       reason of the final evaluation and of training

Every run ends: each wait has a deadline (scoring: the verifier pool's, from the recipe's limits;
``run.time_limit_min``: training, a step's wait for its batch and evaluation), and a sample
whose score is not in by its deadline scores 0 and is counted with its reason.

Resume (``run.resume: auto``): the latest complete checkpoint is loaded, the JSONL files are cut
back to its step, the prompts in flight when it was taken are re-issued first, and the fleet gets
the checkpoint's weights before generating anything.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from tqdm import tqdm

from megatron_rl.config import ConfigError
from megatron_rl.data.sampling import SamplingConfig, check_think_tags_in, load_tokenizer
from megatron_rl.errors import ArgumentParser, UserError, run_cli
from megatron_rl.evaluation.heldout import describe, held_out_pass_at_1
from megatron_rl.fileio import append_jsonl, atomic_write_text, read_jsonl
from megatron_rl.generation.client import FleetClient
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.orchestration.curriculum import Curriculum
from megatron_rl.orchestration.fleet_health import FleetDoctor
from megatron_rl.orchestration.loop import Orchestrator, TimeLimitReached
from megatron_rl.orchestration.preempt import STOP_FILE, Preemption
from megatron_rl.orchestration.preflight import check_fleet_reachable, check_prompt_lengths, check_vocabulary
from megatron_rl.orchestration.problem_sets import read_problem_sets
from megatron_rl.orchestration.recipe import load_config
from megatron_rl.orchestration.rollouts import NoProgressError, Rollouts
from megatron_rl.orchestration.run_records import cut_back, plot_metrics, snapshot_config, write_samples
from megatron_rl.orchestration.sampler import PromptSampler
from megatron_rl.orchestration.trackers import Tracker, open_trackers
from megatron_rl.rewards.pool import VerifierPool
from megatron_rl.rewards.remote import verifier_pool
from megatron_rl.rewards.template import has_chat_template, resolve_system_prompt
from megatron_rl.training.checkpoint import NonFiniteError
from megatron_rl.training.checkpoint_manifest import (
    CheckpointCorruptError,
    checkpoint_dir_name,
    latest_checkpoint,
)
from megatron_rl.training.trainer import PolicyTrainer
from megatron_rl.weight_sync.broadcast import WeightBroadcaster
from megatron_rl.weight_sync.colocated import TensorPusher

# JsonValue and YamlValue are Any: a record read back from JSON (eval.jsonl, the checkpoint's
# extra state) or YAML (config.yaml) has no static shape; the code reading a field checks it.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.data.problems import Problem
    from megatron_rl.fileio import JsonValue
    from megatron_rl.orchestration.loop import StepResult
    from megatron_rl.orchestration.recipe import RunConfig

__all__ = ["held_out_sampling", "main", "run_training"]

# Records of metrics.jsonl a checkpoint keeps (those since the previous checkpoint, at most this
# many): what a resume can rewrite of a line torn in the file.
_METRICS_TAIL = 100


def _evaluate(
    fleet: FleetClient,
    pool: VerifierPool,
    tok: PreTrainedTokenizerBase,
    problems: list[Problem],
    cfg: RunConfig,
    *,
    label: str,
    progress: bool,
    deadline: float | None,
) -> dict[str, JsonValue]:
    """Held-out pass@1 over ``run.eval_k`` samples per problem, cut at ``deadline`` (the time limit)."""
    return held_out_pass_at_1(
        fleet,
        pool,
        tok,
        problems,
        held_out_sampling(cfg),
        cfg.reward,
        label=label,
        progress=progress,
        deadline=deadline,
    )


def held_out_sampling(cfg: RunConfig) -> SamplingConfig:
    """How a run samples its held-out problems (``run.eval_k`` each, its temperature, top-p,
    completion budget, system prompt and environment): what anything compared with its
    evaluations uses."""
    return SamplingConfig(
        k=cfg.run.eval_k,
        max_new_tokens=cfg.reward.l_max,
        temperature=cfg.algorithm.temperature,
        top_p=cfg.loop.top_p,
        seed=cfg.loop.seed + 7919,
        system_prompt=resolve_system_prompt(cfg.data.system_prompt, cfg.reward.think_tags),
        env=cfg.env if cfg.env.enabled else None,  # evaluated through the environment it trains with
    )


def run_training(
    cfg: RunConfig, *, progress: bool = True, stop_after: int | None = None
) -> dict[str, object]:
    """Run (or resume) the recipe ``cfg`` (a :class:`~megatron_rl.config.RunConfig`); returns
    the summary on rank 0 (``{}`` on the other ranks). ``stop_after``: leave after this many
    steps of *this* invocation (tests, benchmarks), checkpointing as usual."""
    if not cfg.model.hf:
        raise ValueError("model.hf: required (an HF folder with config.json, weights, tokenizer)")
    problems, eval_problems = read_problem_sets(cfg.data, needs_reference=not cfg.reward.replaces_correctness)
    if int(os.environ.get("RANK", "0")) == 0:
        check_fleet_reachable(cfg)  # before anything starts: a server that is not there is named
    # SIGTERM / SIGUSR1 / RUN/STOP from here on: the run stops at its next step boundary, saved
    # (orchestration/preempt.py). Rank 0 (torchrun's RANK) looks for the stop file.
    rank0 = int(os.environ.get("RANK", "0")) == 0
    preemption = Preemption(
        cfg.run.preempt_grace_s, stop_file=Path(cfg.run.dir) / STOP_FILE if rank0 else None
    )
    preemption.install()
    try:
        with ExitStack() as stack:  # unwinds in reverse: orchestrator, broadcaster, pool, servers
            run = _Run(cfg, stack, progress=progress, problems=problems, eval_problems=eval_problems)
            preemption.on_request = run.preempt
            if preemption.reason is not None:  # asked before the run existed to hear it
                run.preempt(preemption.reason)
            run.train(stop_after)
            return run.finish()
    finally:
        preemption.uninstall()


class _Run:
    """One invocation of a run: what :func:`run_training` sets up, steps and tears down.

    Every rank builds the trainer, the curriculum and the orchestrator; rank 0 also owns the run
    directory, the fleet (starting local engine servers), the verifier pool, the prompt sampler
    and the rollouts; data-parallel rank 0 of each stage holds a weight broadcaster. Everything
    started is registered on ``stack`` so that an exception anywhere stops it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        stack: ExitStack,
        *,
        progress: bool,
        problems: list[Problem],
        eval_problems: list[Problem] | None,
    ) -> None:
        """Set the run up, in order: trainer (and its checkpoint), run directory and services on
        rank 0, weight broadcaster, rollouts, orchestrator."""
        self.cfg, self.stack, self.progress = cfg, stack, progress
        self.problems = problems  # the training set, checked scorable (rank 0 samples from it)
        self.run_dir = Path(cfg.run.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.t_start = time.monotonic()
        # run.time_limit_min as a time.monotonic(): nothing runs past it (None: no limit).
        limit_s = 60.0 * cfg.run.time_limit_min
        self.deadline: float | None = self.t_start + limit_s if limit_s else None
        self.eval_s = 0.0  # how long the latest evaluation took: the final one is given as long
        # The latest step's work once its batch was in (optimizer step, weight update, checkpoint):
        # a step is started only if it can end before the final evaluation's share of the limit.
        self.step_tail_s = 0.0
        self.saved_step: int | None = None  # the step of the latest checkpoint saved or resumed
        self.evals: list[dict[str, JsonValue]] = []  # eval.jsonl so far (rank 0)
        self.curriculum = Curriculum(cfg)
        self.stopped = "max_steps"  # or "time_limit" / "preempted" / "stop_after": why train() returned
        self.preempted: str | None = None  # the signal or file that asked the run to stop
        # Rank 0's services and held-out problems; None on the other ranks.
        self.fleet: FleetClient | None = None
        self.pool: VerifierPool | None = None
        self.sampler: PromptSampler | None = None
        self.rollouts: Rollouts | None = None
        self.eval_problems: list[Problem] | None = None
        self.trackers: list[Tracker] = []  # rank 0's (run.trackers), opened with the run directory
        self.engines: dict[str, EngineProcess] = {}  # rank 0's local servers, by URL
        self.doctor: FleetDoctor | None = None  # rank 0: restarts or waits for dead servers

        self.tok: PreTrainedTokenizerBase = load_tokenizer(
            cfg.model.tokenizer or cfg.model.hf, chat_template=cfg.data.chat_template
        )
        check_think_tags_in(self.tok, cfg.reward.think_tags, name=cfg.model.tokenizer or cfg.model.hf)
        # Mistakes that would surface minutes later (a failed generation, a sync to no server),
        # named by their field before the trainer or any server starts.
        check_vocabulary(self.tok, cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            sets = [("data.train", problems)] + ([("data.eval", eval_problems)] if eval_problems else [])
            check_prompt_lengths(
                self.tok, cfg, resolve_system_prompt(cfg.data.system_prompt, cfg.reward.think_tags), sets
            )
        self.trainer = PolicyTrainer(cfg.model.hf, cfg.trainer, cfg.algorithm, cfg.batching)
        stack.callback(self.trainer.close)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rank0 = self.rank == 0
        if self.rank0 and not has_chat_template(self.tok):
            print(
                "[data] no chat template (the tokenizer has none, or data.chat_template: none): "
                "prompts are plain text",
                file=sys.stderr,
            )
        self.resume_from = latest_checkpoint(self.ckpt_root) if cfg.run.resume != "never" else None
        if cfg.run.resume == "must" and self.resume_from is None:
            raise FileNotFoundError(f"run.resume: must, but {self.ckpt_root} holds no checkpoint")
        # The checkpoint's extra state (sampler, curriculum, history), as saved by _checkpoint.
        self.extra: dict[str, JsonValue] = {}
        if self.resume_from is not None:
            # From the root: the newest checkpoint whose files match its manifest (a corrupt one
            # is reported and passed over for the one before it).
            self.extra = self.trainer.load_checkpoint(self.ckpt_root)
            self.resume_from = self.ckpt_root / checkpoint_dir_name(int(self.trainer.step))
            self.saved_step = int(self.trainer.step)
        else:
            self.trainer.load_hf(cfg.model.hf)
        # Recent metrics, for metric-triggered curriculum stages.
        self.history: list[dict[str, float]] = list(self.extra.get("history", []))
        # metrics.jsonl's records since the latest checkpoint (saved with the next one, so that
        # a line torn by a crash or a full disk is rewritten whole on resume).
        self.metrics_tail: list[dict[str, float]] = []
        self.curriculum.apply(int(self.extra.get("curriculum_index", 0)), None, None)
        if self.rank0:
            self._prepare_run_dir()
            self.fleet, self.pool, self.sampler = self._start_services()
        self.broadcaster = self._connect_broadcaster()
        if self.rank0:
            self.rollouts = self._make_rollouts()
            self.doctor = self._watch_fleet(self.rollouts)
        self.orch = Orchestrator(
            cfg,
            trainer=self.trainer,
            broadcaster=self.broadcaster,
            rollouts=self.rollouts,
            rank=self.rank,
            world_size=self.world,
        )
        stack.callback(self.orch.stop)
        fleet = self.fleet
        if fleet is not None:  # a fleet all held (back from deaths, old weights): update it now
            self.orch.resync_due = lambda: not fleet.alive and bool(fleet.held_urls())
        self.curriculum.apply(self.curriculum.index, self.orch, self.sampler)  # re-bind to orch
        if self.rank0 and eval_problems is not None:
            self.eval_problems = eval_problems
            if cfg.run.eval_samples:
                self.eval_problems = self.eval_problems[: cfg.run.eval_samples]

    def _prepare_run_dir(self) -> None:
        """Config snapshot (checked against the old one on resume), JSONL files cut back to the
        checkpoint's step, the evaluations made so far."""

        run_dir, step0 = self.run_dir, self.trainer.step
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        snapshot = snapshot_config(run_dir, self.cfg, resuming=self.resume_from is not None)
        r = self.cfg.run
        self.trackers = open_trackers(
            [t for t in r.trackers if t != "jsonl"],
            run_dir,
            run_name=run_dir.resolve().name,
            wandb_project=r.wandb_project,
            wandb_mode=r.wandb_mode,
            mlflow_uri=r.mlflow_uri,
            mlflow_experiment=r.mlflow_experiment,
        )
        for t in self.trackers:
            self.stack.callback(t.close)
            t.config(snapshot)
        cut_back(run_dir, step0, metrics_tail=self.extra.get("metrics_tail", []))
        if (run_dir / "eval.jsonl").exists():
            self.evals = read_jsonl(run_dir / "eval.jsonl")

    def _start_services(self) -> tuple[FleetClient, VerifierPool, PromptSampler]:
        """Rank 0: local engine servers (unless ``fleet.urls``), the fleet client, the verifier
        pool and the prompt sampler (at the checkpoint's cursor)."""

        cfg, stack = self.cfg, self.stack
        urls, engines = list(cfg.fleet.urls), []
        api_key = cfg.fleet.resolved_api_key()
        if not urls:
            # Local servers are never open: without a key from the recipe or the environment,
            # this run's own (only this process and its children know it).
            api_key = api_key or secrets.token_urlsafe(32)
            for i in range(cfg.fleet.local_servers):
                srv = EngineProcess(
                    cfg.model.hf,
                    max_slots=cfg.fleet.max_slots,
                    max_len=cfg.fleet.max_len,
                    threads=cfg.fleet.threads,
                    log_path=self.run_dir / "logs" / f"engine-{i}.log",
                    api_key=api_key,
                )
                stack.callback(srv.stop)
                urls.append(srv.start().url)
                self.engines[srv.url] = srv
                engines.append({"url": srv.url, "pid": srv.pid})
        atomic_write_text(
            self.run_dir / "logs" / "pids.json",
            json.dumps({"trainer": os.getpid(), "engines": engines, "urls": urls}),
        )
        fleet = FleetClient(
            urls,
            update_urls=cfg.fleet.update_urls or None,
            request_timeout_s=cfg.fleet.request_timeout_s,
            api_key=api_key,
            deterministic=cfg.fleet.deterministic,
        )
        stack.callback(fleet.close)
        pool = verifier_pool(cfg.reward)  # reward.remote: verifier servers share the scoring
        # At the end nobody reads what is still queued (a slow reward can leave a long queue).
        stack.callback(pool.close, cancel=True)
        sampler = PromptSampler(self.problems, seed=cfg.loop.seed, shuffle=cfg.data.shuffle)
        for k in ("min_difficulty", "max_difficulty", "drop_solved"):
            setattr(sampler, k, getattr(cfg.data, k))
        self.curriculum.apply(0, None, sampler)
        if "sampler" in self.extra:
            sampler.load_state_dict(self.extra["sampler"])
        return fleet, pool, sampler

    def _connect_broadcaster(self) -> WeightBroadcaster | None:
        """Data-parallel rank 0 of every stage joins the update group (none in colocated mode); the
        fleet then gets the trainer's weights (the initial or the checkpoint's) before it
        generates anything."""
        from megatron.core import (
            parallel_state as ps,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        if ps.get_expert_data_parallel_rank() != 0:  # = dp rank without EP; EP peers join the gathers
            return None
        # Colocated: no update group; the weights go by reference and the fleet's memory is
        # released while the trainer runs (weight_sync/colocated.py).
        kind = TensorPusher if self.cfg.loop.mode == "colocated" else WeightBroadcaster
        broadcaster = kind(self.trainer.hf_tensors, self.fleet, self.cfg.weight_sync)
        broadcaster.connect()
        self.stack.callback(broadcaster.close)
        broadcaster.sync(self.trainer.step)
        return broadcaster

    def _watch_fleet(self, rollouts: Rollouts) -> FleetDoctor:
        """Rank 0: the doctor that restarts dead local servers and waits for external ones; a
        fleet dead for ``fleet.dead_fleet_timeout_s`` stops the run through the rollouts."""
        fleet, f = self.fleet, self.cfg.fleet
        if fleet is None:
            raise RuntimeError(f"rank {self.rank}: only rank 0 holds the fleet")
        doctor = FleetDoctor(
            fleet,
            self.engines,
            max_restarts=f.max_restarts,
            dead_fleet_timeout_s=f.dead_fleet_timeout_s,
            on_dead=rollouts.fail,
        ).start()
        self.stack.callback(doctor.close)
        return doctor

    def _make_rollouts(self) -> Rollouts:
        """Rank 0: generation and scoring over the services :meth:`_start_services` started."""
        trainer, fleet, pool, sampler = self.trainer, self.fleet, self.pool, self.sampler
        if fleet is None or pool is None or sampler is None:
            raise RuntimeError(f"rank {self.rank}: rollouts need the fleet, pool and sampler rank 0 starts")
        return Rollouts.from_config(
            self.cfg,
            fleet=fleet,
            pool=pool,
            sampler=sampler,
            tokenizer=self.tok,
            system_prompt=resolve_system_prompt(self.cfg.data.system_prompt, self.cfg.reward.think_tags),
            version=lambda: int(trainer.step),
        )

    # ------------------------------------------------------------------ the loop

    def train(self, stop_after: int | None) -> None:
        """Optimizer steps until ``loop.max_steps`` (or ``stop_after`` steps of this call), with
        curriculum stages, metrics, samples, checkpoints and periodic evaluation."""

        cfg, trainer, rank0, orch = self.cfg, self.trainer, self.rank0, self.orch
        if rank0 and trainer.step == 0 and not self.evals and self.preempted is None:
            self.evaluate("before")
        orch.start()
        bar = tqdm(
            total=cfg.loop.max_steps,
            initial=trainer.step,
            desc="RL steps",
            unit="step",
            file=sys.stderr,
            disable=not (self.progress and rank0),
            dynamic_ncols=True,
        )
        self.stack.callback(bar.close)
        steps_here = 0
        while trainer.step < cfg.loop.max_steps:
            if stop_after is not None and steps_here >= stop_after:
                self.stopped = "stop_after"
                break
            # Training stops early enough to leave the final evaluation the time the latest took:
            # the batch must be in by then less the time the latest step took to train on its
            # batch (on a real model on CPU that is a minute: without it the last step ran into
            # the evaluation's share and the final evaluation was cut short).
            stop_at = None if self.deadline is None else self.deadline - self.eval_s - self.step_tail_s
            orch.deadline = stop_at
            if self.preempted is not None:
                orch.deadline = 0.0
            why = orch.broadcast_object(self._why_stop(stop_at))  # rank 0's view decides
            if why is not None:
                self._stop_early(why, "")
                break
            self._advance_curriculum()
            before = int(trainer.step)
            try:
                result = orch.step()
            except TimeLimitReached:  # rank 0 gave up waiting for the batch: every rank is here
                why = orch.broadcast_object(self._why_stop(stop_at)) or "time_limit"
                self._stop_early(why, " while waiting for its batch (not trained)")
                break
            steps_here += 1
            if rank0:
                self._record(result)
                bar.update(1)
                m = result.metrics
                bar.set_postfix(
                    reward=f"{m.get('reward/mean', 0):.2f}",
                    pass_=f"{m.get('pass_rate', 0):.2f}",
                    len=f"{m.get('length/mean', 0):.0f}",
                    stale=f"{m.get('staleness/mean', 0):.1f}",
                )
            # A step whose optimizer steps were all skipped (non-finite) leaves nothing new to save.
            moved = trainer.step > before
            due = moved and cfg.run.checkpoint_every and trainer.step % cfg.run.checkpoint_every == 0
            t_save = time.monotonic()
            if due or (moved and trainer.step >= cfg.loop.max_steps):
                self._checkpoint()
            m = result.metrics
            self.step_tail_s = (
                float(m.get("train/step_time_s", 0.0))
                + float(m.get("weight_sync/seconds", 0.0))
                + time.monotonic()
                - t_save
            )
            if (
                rank0
                and cfg.run.eval_every
                and trainer.step % cfg.run.eval_every == 0
                and trainer.step < cfg.loop.max_steps
            ):
                self.evaluate(f"step {trainer.step}")
        bar.close()
        orch.stop()

    def preempt(self, reason: str) -> None:
        """Asked to stop (a signal, the stop file): from a signal handler or another thread, so
        it only sets flags; the step boundary (or the wait for a batch, past its deadline)
        acts on them. Handed to :class:`Preemption` once the run is built."""
        self.preempted = reason
        self.orch.deadline = 0.0  # a wait for the batch gives up at its next look

    def _why_stop(self, stop_at: float | None) -> str | None:
        """Why the loop must stop now, as rank 0 sees it: preempted, time limit, or None."""
        if self.preempted is not None:
            return "preempted"
        if stop_at is not None and time.monotonic() >= stop_at:
            return "time_limit"
        return None

    def _stop_early(self, why: str, where: str) -> None:
        """Stop at the current step (preempted or at run.time_limit_min): say so, and checkpoint
        (collective)."""
        self.stopped = why
        cfg, step = self.cfg, self.trainer.step
        if self.rank0 and why == "time_limit":
            print(
                f"[time limit] {cfg.run.time_limit_min:g} min reached at step {step}{where}: "
                "finishing here (run again to resume)",
                file=sys.stderr,
                flush=True,
            )
        elif self.rank0:
            print(f"[preempt] stopping at step {step}{where}", file=sys.stderr, flush=True)
        if self.saved_step != step:  # not saved at this step yet (step 0 of a new run included)
            self._checkpoint()

    def _checkpoint(self) -> None:
        extra: dict[str, object] = {
            "curriculum_index": self.curriculum.index,
            "history": self.history[-20:],
            "metrics_tail": self.metrics_tail[-_METRICS_TAIL:],
        }
        if self.rollouts is not None:  # its sampler's cursor and the counters, read at one instant
            extra.update(self.rollouts.state_dict())
        self.trainer.save_checkpoint(
            self.ckpt_root, extra=extra, keep_last=self.cfg.run.keep_last, carried_from=self.cfg.model.hf
        )
        self.saved_step = int(self.trainer.step)
        self.metrics_tail = []

    def _advance_curriculum(self) -> None:
        """Rank 0 decides whether the next stage is due; every rank applies it."""
        cur = self.curriculum
        due = self.rank0 and cur.due(self.trainer.step, self.history)
        upto = self.orch.broadcast_object(cur.index + 1 if due else cur.index)
        for name in cur.apply(upto, self.orch, self.sampler):
            if self.rank0:
                print(f"[curriculum] step {self.trainer.step}: entering {name}", file=sys.stderr)

    def _record(self, result: StepResult) -> None:
        """Rank 0: metrics.jsonl (+ the trackers), samples.jsonl and ledger.jsonl of a step."""
        m = result.metrics
        m["curriculum/stage"] = float(self.curriculum.index)
        m["time/elapsed_s"] = time.monotonic() - self.t_start
        if self.doctor is not None:
            m["fleet/restarts"] = float(self.doctor.total_restarts)
        self.history.append({k: v for k, v in m.items() if not k.startswith("staleness/hist")})
        self.history = self.history[-50:]
        self.metrics_tail.append(m)
        append_jsonl(self.run_dir / "metrics.jsonl", [m])
        for t in self.trackers:
            t.log(m, int(m["step"]))
        write_samples(self.run_dir, result, self.orch.last_dropped, samples=self.cfg.run.save_samples)

    def evaluate(self, label: str) -> None:
        """Rank 0: held-out pass@1 now, appended to eval.jsonl."""
        if self.eval_problems is None:
            return
        fleet, pool = self.fleet, self.pool
        if fleet is None or pool is None:  # eval_problems are read on rank 0, which holds both
            raise RuntimeError(f"rank {self.rank}: evaluation needs rank 0's fleet and verifier pool")
        res = _evaluate(
            fleet,
            pool,
            self.tok,
            self.eval_problems,
            self.cfg,
            label=label,
            progress=self.progress,
            deadline=self.deadline,
        )
        res["step"] = int(self.trainer.step)
        self.eval_s = float(res["seconds"])
        self.evals.append(res)
        append_jsonl(self.run_dir / "eval.jsonl", [res])
        print(f"[eval {label}] step {res['step']}: {describe(res)}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ teardown

    def finish(self) -> dict[str, object]:
        """The final policy as an HF folder (every rank takes part), then on rank 0 the final
        evaluation, the plots and ``summary.json``. A preempted run writes the summary only (the
        checkpoint is saved; the grace is short)."""
        cfg, trainer, run_dir = self.cfg, self.trainer, self.run_dir
        preempted = self.stopped == "preempted"
        if not preempted:
            trainer.export_hf(run_dir / "hf", like=cfg.model.hf)
        if not self.rank0:
            return {}
        evals = self.evals
        finished = not preempted and (trainer.step >= cfg.loop.max_steps or self.stopped == "time_limit")
        # A run stopped by its time limit and resumed later is evaluated again at its new end (and
        # so is one whose final evaluation the limit cut short).
        last = evals[-1] if evals else {}
        done = last.get("label") == "after" and last["step"] == trainer.step and not last.get("partial")
        if finished and not done:
            self.evaluate("after")
        plots = (
            plot_metrics(run_dir / "metrics.jsonl", evals, run_dir / "plots")
            if (run_dir / "metrics.jsonl").exists()
            else []
        )
        for t in self.trackers:
            for path in plots:
                t.artifact(path)

        def latest(label: str) -> dict[str, JsonValue]:  # the latest evaluation of that label
            return next((e for e in reversed(evals) if e["label"] == label), {})

        scored = self.rollouts.snapshot_stats() if self.rollouts is not None else {}

        summary = {
            "steps": int(trainer.step),
            "stopped": self.stopped,
            "preempted_by": self.preempted,
            "checkpoint": str(self.ckpt_root / checkpoint_dir_name(self.saved_step))
            if self.saved_step is not None
            else None,
            "wall_s": time.monotonic() - self.t_start,
            "resumed_from": str(self.resume_from) if self.resume_from else None,
            "pass@1_before": latest("before").get("pass@1"),
            "pass@1_after": latest("after").get("pass@1"),
            # Samples per reason: the final evaluation's, and those of training (this invocation).
            "eval_after_reasons": latest("after").get("reasons"),
            "eval_after_partial": bool(latest("after").get("partial")),
            "train_reasons": {k[7:]: v for k, v in sorted(scored.items()) if k.startswith("reason/")},
            # How the trajectories of a multi-turn environment ended, per reason (empty without one).
            "env_ends": {k[4:]: v for k, v in sorted(scored.items()) if k.startswith("env/")},
            # All of this invocation's server restarts; a step's fleet/restarts counts only those
            # before it (a server killed after the last rollout is started again after it).
            "fleet_restarts": self.doctor.total_restarts if self.doctor is not None else None,
            "plots": [str(p) for p in plots],
            "run_dir": str(run_dir),
        }
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary


def main(argv: list[str] | None = None) -> int:
    """``megatron-rl train RECIPE.yaml [section.key=value ...]``."""

    p = ArgumentParser(prog="megatron-rl train", description=__doc__.split("\n")[0])
    p.add_argument("recipe", help="YAML recipe (see examples/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loop.max_steps=10")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides, paths=True)  # before anything starts
    except ConfigError as e:
        print(f"megatron-rl train: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_training(cfg, progress=not args.no_progress)
    except UserError:  # one line with the exit code of its kind (run_cli prints it)
        raise
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-rl train: {e}", file=sys.stderr)
        return 2
    except (NoProgressError, NonFiniteError) as e:  # the run cannot go on: why, where it stopped
        print(f"megatron-rl train: stopped: {e}", file=sys.stderr)
        return 1
    except CheckpointCorruptError as e:  # nothing intact to resume from: never start over silently
        print(
            f"megatron-rl train: {e}\n(move the checkpoints aside, or run.resume: never, to start over)",
            file=sys.stderr,
        )
        return 1
    if summary:
        print(json.dumps(summary))
    if summary.get("stopped") == "preempted":  # the one line a scheduler's log should end with
        print(
            f"megatron-rl train: preempted ({summary['preempted_by']}) at step {summary['steps']}; "
            f"saved {summary['checkpoint']}; run the same command again to resume from it",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl train", main))
