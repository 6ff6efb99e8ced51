"""SFT warm-up: teach the tiny model the paper's output format and short worked solutions.

    result = run_sft(init_dir, train_problems, "out/sft", SFTConfig(steps=600))
    result.folder     # HF folder of the trained weights (the built-in engine loads it)

A trace is the format the reward checks, kept as short as the reasoning allows (every token is
CPU time in SFT, in generation and in every RL step)::

    <think>First multiply: 4 * 7 = 28. Then add: 15 + 28 = 43.</think>The answer is \\boxed{43}.

followed by EOS. The thinking is the problem's worked steps, in English words around the numbers
so the language check finds English in both sections (the bonus the reward gives).

**A teacher that slips.** A fraction ``SFTConfig.slip_rate`` of the traces the model sees get
the last computation wrong by one digit, and box that wrong result (:func:`format_trace` with
``slip``), a new slip drawn every time a problem comes round::

    <think>First multiply: 4 * 7 = 28. Then add: 15 + 28 = 48.</think>The answer is \\boxed{48}.

This is the room GRPO is given, on purpose. The model imitates the teacher: the right digit
stays the most likely one, so greedy decoding is hardly hurt, but sampled at temperature 1 it
slips about as often as the teacher did. Not slipping is one behaviour shared by every problem,
so the reward pushes every group the same way. Measured on 2 CPU cores with the defaults
(600 steps, 30% slips): held-out pass@1 0.14 at temperature 1 and 0.29 greedy after SFT, and
0.24-0.26 at temperature 1 after 7 minutes of synchronous GRPO (~400 steps of 16 prompts x 8
samples, lr 5e-5 to 1e-4). Without slips the SFT model is nearly as good sampled as greedy
(0.24 vs 0.31), and what RL must then teach -- the arithmetic facts themselves -- it learns from
a scalar reward too slowly for a CPU demonstration: +3 to +5 points in 7 minutes. Real SFT data
(distilled or human traces) has slips too. ``slip_rate=0`` gives plain SFT.

Training is :meth:`PolicyTrainer.sft_step` (mean NLL of the trace tokens; prompt tokens carry no
loss) on one CPU rank: the trainer sets up a one-rank gloo group itself.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.config import ConfigFieldError, check_range
from megatron_rl.quickstart.problems import Problem
from megatron_rl.quickstart.tokenizer import QUICKSTART_PROMPT, load_tokenizer, prompt_ids, text_ids
from megatron_rl.rewards.format import check_think_tags
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS, resolve_system_prompt
from megatron_rl.training.config import OptimConfig, TrainerConfig
from megatron_rl.training.trainer import PolicyTrainer

__all__ = [
    "SFTConfig",
    "SFTResult",
    "ThreadGovernor",
    "format_trace",
    "make_trainer",
    "run_sft",
    "sft_pairs",
    "slipped_answer",
]


@dataclass(kw_only=True)
class SFTConfig:
    """The SFT warm-up's schedule."""

    steps: int = 600  # optimizer steps (~2.5 min on 2 idle cores)
    batch_size: int = 64  # sequences per step
    lr: float = 3e-3  # peak learning rate (tiny model from scratch: large)
    min_lr: float = 3e-4  # reached at the last step (cosine decay)
    warmup_steps: int = 20  # linear warm-up
    slip_rate: float = 0.3  # share of traces whose last result is one digit off (see above)
    seed: int = 0  # order of the training problems and the slips
    threads: int = 0  # torch intra-op threads; 0 = chosen by measured step time (ThreadGovernor)
    token_budget: int = 8192  # tokens per microbatch (all of a step fits in one here)
    think_tags: tuple[str, str] = DEFAULT_THINK_TAGS  # the traces' (the run's reward.think_tags)
    # The prompts' system prompt, as a recipe's data.system_prompt ("paper", "none" or a text with
    # {think_open} {think_close}): SFT trains on the prompts the RL run will send.
    system_prompt: str = QUICKSTART_PROMPT

    def __post_init__(self):
        check_range("steps", self.steps, low=1)
        check_range("batch_size", self.batch_size, low=1)
        check_range("lr", self.lr, low=0.0, low_open=True)
        check_range("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_range("warmup_steps", self.warmup_steps, low=0)
        if self.warmup_steps >= self.steps:
            raise ConfigFieldError("warmup_steps", f"must be < steps ({self.steps}), got {self.warmup_steps}")
        check_range("slip_rate", self.slip_rate, low=0.0, high=1.0)
        check_range("threads", self.threads, low=0)
        check_range("token_budget", self.token_budget, low=16)
        check_think_tags(self.think_tags)


@dataclass
class SFTResult:
    folder: Path  # HF folder of the trained model
    losses: list[float] = field(default_factory=list)  # per step
    seconds: float = 0.0  # wall time of the training loop and the export


def format_trace(
    problem: Problem, *, slip: str | None = None, think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS
) -> str:
    """The target completion for ``problem`` (without EOS, which is a token, not text), its
    thinking between ``think_tags``.

    ``slip``: a wrong value (see :func:`slipped_answer`) written as the result of the last step
    and boxed, instead of the answer.
    """
    steps = list(problem.steps)
    answer = problem.answer
    if slip is not None:
        if not steps[-1].endswith(f" {answer}."):
            raise ValueError(f"{problem.id}: the last step does not end with the answer: {steps[-1]!r}")
        steps[-1] = f"{steps[-1][: -len(answer) - 1]}{slip}."
        answer = slip
    return f"{think_tags[0]}{' '.join(steps)}{think_tags[1]}The answer is \\boxed{{{answer}}}."


def slipped_answer(answer: str, rng: random.Random) -> str:
    """``answer`` (an integer) with one digit changed to another: never a leading zero, never
    ``-0``, never the answer itself."""
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    i = rng.randrange(len(digits))
    banned = {digits[i]}
    if i == 0 and (len(digits) > 1 or sign):
        banned.add("0")
    new = rng.choice([d for d in "0123456789" if d not in banned])
    return f"{sign}{digits[:i]}{new}{digits[i + 1 :]}"


def sft_pairs(
    tokenizer,
    problems: list[Problem],
    *,
    slip_rate: float = 0.0,
    rng: random.Random | None = None,
    think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS,
    system_prompt: str = QUICKSTART_PROMPT,
) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, trace_ids + [EOS])`` per problem, for ``build_sft_batch``: the prompt with
    ``system_prompt`` (as ``data.system_prompt``: "paper", "none" or a text; the quick start's
    one line by default) and traces with ``think_tags``; each trace slips with probability
    ``slip_rate`` (drawn from ``rng``)."""
    system_prompt = resolve_system_prompt(system_prompt, think_tags)
    rng = rng or random.Random(0)
    eos = tokenizer.eos_token_id
    pairs = []
    for p in problems:
        slip = slipped_answer(p.answer, rng) if rng.random() < slip_rate else None
        pairs.append(
            (
                prompt_ids(tokenizer, p.problem, system_prompt=system_prompt),
                text_ids(tokenizer, format_trace(p, slip=slip, think_tags=think_tags)) + [eos],
            )
        )
    return pairs


def make_trainer(
    folder: str | os.PathLike,
    *,
    lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    decay_steps: int = 0,
    token_budget: int = 8192,
    grpo=None,
    seed: int = 1234,
):
    """A one-rank fp32 :class:`PolicyTrainer` holding the weights of the HF folder ``folder``.

    Cosine decay to ``min_lr`` at ``decay_steps`` when given, else a constant ``lr`` after the
    warm-up. ``grpo``: the :class:`GRPOConfig` for RL steps (default: the paper's).
    """

    style: Literal["cosine", "constant"] = "cosine" if decay_steps else "constant"
    optim = OptimConfig(
        lr=lr,
        min_lr=min_lr if decay_steps else 0.0,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_style=style,
        clip_grad=1.0,
    )
    # Padded rows, not packed ones: without Transformer Engine a packed row is attended with a
    # dense [row, row] mask, quadratic in the whole microbatch (measured, one thread: 7 s for a
    # step of 64 sequences packed into one row, 0.5 s for the same sequences padded).
    batching = BatchingConfig(token_budget=token_budget, layout="padded")
    cfg = TrainerConfig(optim=optim, precision="fp32", distributed_optimizer="off", seed=seed)
    trainer = PolicyTrainer(str(folder), cfg, grpo or GRPOConfig(), batching)
    trainer.load_hf(folder)
    return trainer


class ThreadGovernor:
    """Chooses torch's intra-op thread count by measured step time, and re-checks it as load moves.

    On a small machine shared with other work, more threads are not reliably faster: on the
    2-core machine this was tuned on, an SFT step took 0.25 s with 2 threads and 0.46 s with 1
    when the machine was idle, but 2-4 s with 2 threads and 0.6 s with 1 while another process
    kept a core busy (OpenMP threads wait at every barrier for the one that is descheduled).
    So each choice runs ``trials`` steps (the minimum time counts), the fastest is used, and the
    check is repeated every ``every`` steps, or at once when a step takes ``slack`` times the
    time measured for the choice in use. The thread count changes reduction order only: results
    differ in the last bits of fp32, not in behaviour.
    """

    def __init__(
        self, choices: tuple[int, ...] | None = None, *, every: int = 50, trials: int = 2, slack: float = 1.5
    ):
        cores = os.cpu_count() or 1
        self.choices = tuple(sorted(set(choices or (1, cores))))
        self.every, self.trials, self.slack = every, trials, slack
        self.best = self.choices[0]
        self._times: dict[int, float] = {}
        self._probe: list[int] = []  # choices still to run in the current check, one per step
        self._checking = False
        self._since_check = every  # so the first step starts a check
        self._current = self.best

    def before_step(self) -> None:
        """Set the thread count for the next step."""
        if not self._checking and self._since_check >= self.every:
            self._probe = [c for c in self.choices for _ in range(self.trials)]
            self._times.clear()
            self._checking = True
        self._current = self._probe.pop(0) if self._checking else self.best
        torch.set_num_threads(self._current)

    def after_step(self, seconds: float) -> None:
        """Record the step's time: finish a check, or start one when the step was slow."""
        c = self._current
        if self._checking:
            self._times[c] = min(seconds, self._times.get(c, float("inf")))
            if not self._probe:
                self.best = min(self._times, key=self._times.__getitem__)
                self._checking, self._since_check = False, 0
            return
        self._since_check += 1
        if seconds > self.slack * self._times[c]:
            self._since_check = self.every


def _batches(problems: list[Problem], batch_size: int, seed: int):
    """Endless shuffled epochs over ``problems``, ``batch_size`` at a time."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            extra = list(range(len(problems)))
            rng.shuffle(extra)
            order.extend(extra)
        yield [problems[i] for i in order[:batch_size]]
        del order[:batch_size]


def run_sft(
    init_folder: str | os.PathLike,
    problems: list[Problem],
    out: str | os.PathLike,
    cfg: SFTConfig | None = None,
    *,
    progress: bool = True,
) -> SFTResult:
    """Train on the traces of ``problems`` from the HF folder ``init_folder``; export to ``out``."""

    cfg = cfg or SFTConfig()
    if not problems:
        raise ValueError("run_sft: no training problems")
    tokenizer = load_tokenizer(init_folder)
    slips = random.Random(cfg.seed + 1)
    threads = torch.get_num_threads()
    governor = ThreadGovernor((cfg.threads,) if cfg.threads else None)
    start = time.perf_counter()
    trainer = make_trainer(
        init_folder,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        token_budget=cfg.token_budget,
    )
    try:
        losses = []
        bar = tqdm(total=cfg.steps, desc="sft", unit="step", disable=not progress)
        for _step, batch in zip(range(cfg.steps), _batches(problems, cfg.batch_size, cfg.seed)):
            pairs = sft_pairs(
                tokenizer,
                batch,
                slip_rate=cfg.slip_rate,
                rng=slips,
                think_tags=cfg.think_tags,
                system_prompt=cfg.system_prompt,
            )
            governor.before_step()
            metrics = trainer.sft_step(build_sft_batch(pairs))
            governor.after_step(metrics["step_time_s"])
            losses.append(metrics["loss"])
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{metrics['lr']:.1e}", threads=governor.best)
        bar.close()
        folder = Path(trainer.export_hf(out, like=init_folder))
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    return SFTResult(folder=Path(folder), losses=losses, seconds=time.perf_counter() - start)
