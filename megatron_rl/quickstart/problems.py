"""Verifiable math problems for the CPU quick start: integer arithmetic and linear equations.

    problems = generate_problems(ProblemConfig(seed=0))
    train, held_out = split_problems(problems, held_out_fraction=0.1)
    write_problems("train.jsonl", (p.to_record() for p in train))   # megatron_rl.data.problems

Every problem comes with its reference answer (an integer as a string, which math-verify reads)
and the worked steps a solver writes down (``Problem.steps``), from which
:mod:`megatron_rl.quickstart.sft` builds the SFT traces. The steps are never exported: the JSONL
is the prompt set RL samples from, as any other problem set.

Kinds and difficulty levels (the knob is ``ProblemConfig.difficulty_weights``):

====  ====================================  =============================================
 lvl  arithmetic                            linear equation
====  ====================================  =============================================
  1   ``a + b``, ``a - b`` (result >= 0)    ``x + b = c``, ``x - b = c`` (0 <= x <= 9)
  2   ``a * b + c``, ``a * b - c``          ``a x + b = c``, ``a x - b = c`` (1 <= x <= 9)
  3   ``a * b + c * d``, ``a * b - c * d``  the same with -9 <= x <= -1
====  ====================================  =============================================

Operands are single digits (``a`` of a linear equation 2..9): what makes a level hard is how many
facts of the multiplication and addition tables a solution chains, and carries and signs, not
the size of the numbers. Measured with the quick start's 0.6 M-parameter model after 300 SFT
steps: held-out pass@1 0.19 with these problems, 0.08 with two-digit operands.

``count`` draws give about 8 800 distinct problems: the warm-up's 600 x 64 sequences are then
~5 epochs. With ~2 600 problems (13 epochs) the model memorised them (greedy pass@1 0.47 on
training problems, 0.30 held out), and RL raised the training problems' pass rate only.

Problems are generated from ``random.Random(seed)`` alone, so a seed names a problem set. The
train / held-out split is decided by a hash of the problem *text* (not by position or seed), so
two problems with the same text always land on the same side: the splits can never share a
problem, however the sets were generated. Duplicates within a set are dropped.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import ConfigFieldError, check_range

__all__ = [
    "KINDS",
    "LEVELS",
    "Problem",
    "ProblemConfig",
    "generate_problems",
    "is_held_out",
    "split_problems",
]

KINDS = ("arithmetic", "linear")
LEVELS = (1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One problem: text, reference answer and the worked steps that reach it."""

    id: str  # stable: "<kind>-<level>-<hash of the text>"
    problem: str  # the statement shown to the model
    answer: str  # reference answer (an integer, as math-verify parses it)
    difficulty: int  # 1..3, see the module docstring
    kind: str  # arithmetic | linear
    steps: tuple[str, ...] = ()  # worked solution, one short sentence per step
    task: Literal["math", "code"] = "math"  # always math here; typed as the data layer's Problem.task

    def to_record(self) -> dict[str, str | int]:
        """The JSONL record (the fields every problem set of the project has)."""
        return {
            "id": self.id,
            "problem": self.problem,
            "answer": self.answer,
            "task": self.task,
            "difficulty": self.difficulty,
        }


@dataclass(kw_only=True)
class ProblemConfig:
    """What problems to draw and how many."""

    count: int = 30000  # draws; ~8 800 distinct problems remain (few epochs: no memorising)
    seed: int = 0  # names the problem set: same seed, same problems
    linear_fraction: float = 0.4  # share of linear equations; the rest is arithmetic
    # Relative weight of levels 1, 2, 3 (need not sum to 1): the difficulty knob.
    difficulty_weights: tuple[float, float, float] = (0.25, 0.45, 0.3)

    def __post_init__(self) -> None:
        check_range("count", self.count, low=1)
        check_range("seed", self.seed, low=0)
        check_range("linear_fraction", self.linear_fraction, low=0.0, high=1.0)
        w = tuple(self.difficulty_weights)
        if len(w) != len(LEVELS) or min(w) < 0 or sum(w) <= 0:
            raise ConfigFieldError(
                "difficulty_weights", f"need {len(LEVELS)} non-negative weights with a positive sum, got {w}"
            )
        self.difficulty_weights = (w[0], w[1], w[2])  # len(w) == len(LEVELS) == 3, checked above


def _problem(kind: str, level: int, text: str, answer: int, steps: list[str]) -> Problem:
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    return Problem(
        id=f"{kind}-{level}-{digest}",
        problem=text,
        answer=str(answer),
        difficulty=level,
        kind=kind,
        steps=tuple(steps),
    )


def _arithmetic(rng: random.Random, level: int) -> Problem:
    r = rng.randint
    if level == 1:
        a, b = r(0, 9), r(0, 9)
        if rng.random() < 0.5:
            return _problem("arithmetic", 1, f"What is {a} + {b}?", a + b, [f"We add: {a} + {b} = {a + b}."])
        a, b = max(a, b), min(a, b)  # level 1 stays non-negative
        return _problem("arithmetic", 1, f"What is {a} - {b}?", a - b, [f"We subtract: {a} - {b} = {a - b}."])
    if level == 2:
        a, b, c = r(2, 9), r(2, 9), r(1, 9)
        op = rng.choice("+-")
        value = a * b + c if op == "+" else a * b - c
        verb = "add" if op == "+" else "subtract"
        return _problem(
            "arithmetic",
            2,
            f"What is {a} * {b} {op} {c}?",
            value,
            [f"First multiply: {a} * {b} = {a * b}.", f"Then {verb}: {a * b} {op} {c} = {value}."],
        )
    a, b, c, d = r(2, 9), r(2, 9), r(2, 9), r(2, 9)
    op = rng.choice("+-")
    value = a * b + c * d if op == "+" else a * b - c * d
    verb = "add" if op == "+" else "subtract"
    return _problem(
        "arithmetic",
        3,
        f"What is {a} * {b} {op} {c} * {d}?",
        value,
        [
            f"First multiply: {a} * {b} = {a * b} and {c} * {d} = {c * d}.",
            f"Then {verb}: {a * b} {op} {c * d} = {value}.",
        ],
    )


def _linear(rng: random.Random, level: int) -> Problem:
    r = rng.randint
    if level == 1:
        x, b = r(0, 9), r(1, 9)
        if rng.random() < 0.5:
            return _problem(
                "linear",
                1,
                f"Solve for x: x + {b} = {x + b}",
                x,
                [f"Subtract {b} from both sides: x = {x + b} - {b} = {x}."],
            )
        return _problem(
            "linear",
            1,
            f"Solve for x: x - {b} = {x - b}",
            x,
            [f"Add {b} to both sides: x = {x - b} + {b} = {x}."],
        )
    a, b = r(2, 9), r(1, 9)
    # Level 3: negative solutions, and constants that make the right-hand side cross zero.
    x = r(1, 9) if level == 2 else -r(1, 9)
    if rng.random() < 0.5:
        c = a * x + b
        return _problem(
            "linear",
            level,
            f"Solve for x: {a}x + {b} = {c}",
            x,
            [f"Subtract {b} from both sides: {a}x = {c} - {b} = {a * x}.", f"Divide by {a}: x = {x}."],
        )
    c = a * x - b
    return _problem(
        "linear",
        level,
        f"Solve for x: {a}x - {b} = {c}",
        x,
        [f"Add {b} to both sides: {a}x = {c} + {b} = {a * x}.", f"Divide by {a}: x = {x}."],
    )


def generate_problems(cfg: ProblemConfig) -> list[Problem]:
    """``cfg.count`` draws, duplicates (same text) dropped; deterministic in ``cfg``."""
    rng = random.Random(cfg.seed)
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(cfg.count):
        level = rng.choices(LEVELS, weights=cfg.difficulty_weights)[0]
        make = _linear if rng.random() < cfg.linear_fraction else _arithmetic
        p = make(rng, level)
        if p.problem not in seen:
            seen.add(p.problem)
            out.append(p)
    return out


def is_held_out(problem_text: str, held_out_fraction: float) -> bool:
    """Whether a problem belongs to the held-out split: a hash of its text, not its position."""
    h = int.from_bytes(hashlib.sha256(problem_text.encode()).digest()[:8], "big")
    return h / 2.0**64 < held_out_fraction


def split_problems(
    problems: Iterable[Problem], held_out_fraction: float = 0.1
) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)`` by :func:`is_held_out`; order kept within each split."""
    check_range("held_out_fraction", held_out_fraction, low=0.0, high=1.0)
    train: list[Problem] = []
    held_out: list[Problem] = []
    for p in problems:
        (held_out if is_held_out(p.problem, held_out_fraction) else train).append(p)
    return train, held_out
