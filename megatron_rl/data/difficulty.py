"""Difficulty filtering: keep the problems a model sometimes, but not always, solves.

For every problem, k completions (16 in the paper) are sampled and scored; a problem is kept when
its pass rate lies strictly between ``low`` and ``high`` (defaults 0 and 1: drop never-solved and
always-solved problems). A problem is *flagged* when more than ``majority`` (default half) of all
its completions agree on one answer that is not the reference -- the mark of a wrong reference,
common in scraped sets; flagged problems are dropped (``likely_wrong_reference``) unless
``drop_flagged`` is off, and listed apart for review with the answer the model agreed on.
Agreement is decided by the real math verifier (``\\frac12`` and ``0.5`` are one answer), in the
verifier pool.

The logic (:func:`difficulty_filter`) takes completions already scored -- from
:func:`megatron_rl.data.sampling.sample_and_score` or from a file of pre-scored completions
(:func:`attempts_from_scored`, e.g. the output of ``megatron-rl reward``) -- so it can be run and
tested apart from generation.

Two-stage recipe (Magistral, section 4)
---------------------------------------
A single pass with a weak model discards hard-but-solvable problems as "never solved". So:

1. Stage 1 -- filter with the model you have (the paper: Mistral Large 2), 16 samples per problem::

       megatron-rl curate difficulty --input math.jsonl --output stage1.jsonl \\
           --servers http://gen0:30000,http://gen1:30000 --tokenizer weak-model/ --k 16

2. Train an RL model on ``stage1.jsonl`` (``megatron-rl train``): it becomes stronger than the
   filter model on exactly this distribution.
3. Stage 2 -- re-filter the *full* format-filtered set (not ``stage1.jsonl``) with that stronger
   checkpoint; this pass also drops problems whose reference the stronger model contradicts::

       megatron-rl curate difficulty --input math.jsonl --output stage2.jsonl \\
           --model rl-checkpoint-hf/ --k 16 --high 1.0

   Review ``stage2.flagged.jsonl`` (problems whose majority answer disagrees with the
   reference) before throwing them away: some are fixable. As training goes on, re-run stage 2
   with ``--high`` lowered, or on problems dropped as too hard, to build harder curriculum splits.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from tqdm import tqdm

from megatron_rl.config import ConfigFieldError, check_range
from megatron_rl.data.problems import DataError, Problem, read_records
from megatron_rl.data.report import CurationReport
from megatron_rl.data.sampling import Attempt, extract_answer
from megatron_rl.rewards.math import MathConfig, verify_math
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool, max_workers
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = [
    "Difficulty",
    "DifficultyConfig",
    "attempts_from_scored",
    "cluster_answers",
    "difficulty_filter",
    "normalise_answer",
]


class Scored(Protocol):
    """What the filter needs of a completion: whether it was right, and its final answer."""

    correct: bool
    answer: str | None


@dataclass(kw_only=True)
class DifficultyConfig:
    """Which pass rates are kept, and when a reference is suspect."""

    low: float = 0.0  # keep problems whose pass rate is strictly above this
    high: float = 1.0  # ... and strictly below this
    majority: float = 0.5  # flag when more than this share of completions agree on a wrong answer
    drop_flagged: bool = True  # drop flagged problems (else keep them if the pass rate fits)
    workers: int = 2  # verifier processes (answer clustering)
    math: MathConfig = field(default_factory=MathConfig)

    def __post_init__(self):
        check_range("low", self.low, low=0.0, high=1.0)
        check_range("high", self.high, low=0.0, high=1.0)
        if self.low >= self.high:
            raise ConfigFieldError("high", f"must be > low ({self.low}), got {self.high}")
        check_range("majority", self.majority, low=0.0, high=1.0, high_open=True)
        check_range("workers", self.workers, low=1, high=max_workers())  # this machine runs them


@dataclass(kw_only=True)
class Difficulty:
    """The verdict on one problem."""

    problem_id: str
    samples: int
    correct: int
    pass_rate: float
    majority_answer: str | None  # the most common wrong answer (None: no wrong answer given)
    majority_count: int  # how many completions gave it
    flagged: bool  # majority_count > majority * samples
    decision: str  # "kept", or why it was dropped

    def to_json(self) -> dict[str, JsonValue]:
        return asdict(self)


_SPACING = re.compile(r"\s+|\\[,;!: ]|\\left|\\right")


def normalise_answer(answer: str) -> str:
    """Cheap canonical spelling: no spaces or spacing commands, ``\\dfrac``/``\\tfrac`` as
    ``\\frac``, no surrounding ``$`` or trailing full stop. Exact-match grouping before the
    verifier is asked."""
    a = answer.strip().strip("$")
    a = _SPACING.sub("", a).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return a.rstrip(".")


def cluster_answers(answers: Sequence[str], cfg: MathConfig) -> list[int]:
    """A cluster label per answer; two answers share one when the math verifier finds them
    equivalent (greedy: each distinct answer, most frequent first, joins the first cluster whose
    representative it matches). Runs in a pool worker (math-verify's time-outs use SIGALRM)."""
    norms = [normalise_answer(a) for a in answers]
    counts = Counter(norms)
    reps: list[str] = []
    label_of: dict[str, int] = {}
    for a, _ in counts.most_common():
        for c, rep in enumerate(reps):
            if verify_math(f"\\boxed{{{a}}}", rep, cfg).correct:
                label_of[a] = c
                break
        else:
            label_of[a] = len(reps)
            reps.append(a)
    return [label_of[n] for n in norms]


def _exact_clusters(answers: Sequence[str]) -> list[int]:
    ids: dict[str, int] = {}
    return [ids.setdefault(normalise_answer(a), len(ids)) for a in answers]


def _majority(wrong: list[str], labels: list[int]) -> tuple[str | None, int]:
    if not wrong:
        return None, 0
    label, count = Counter(labels).most_common(1)[0]
    return wrong[labels.index(label)], count


def _decide(d: Difficulty, cfg: DifficultyConfig) -> str:
    if d.samples == 0:
        return "no_samples"
    if d.flagged and cfg.drop_flagged:
        return "likely_wrong_reference"
    if d.pass_rate <= cfg.low:
        return "never_solved" if cfg.low == 0 else f"too_hard (pass rate <= {cfg.low:g})"
    if d.pass_rate >= cfg.high:
        return "always_solved" if cfg.high == 1 else f"too_easy (pass rate >= {cfg.high:g})"
    return "kept"


def difficulty_filter(
    problems: Sequence[Problem],
    attempts: Mapping[str, Sequence[Scored]],
    cfg: DifficultyConfig | None = None,
    *,
    pool: VerifierPool | None = None,
    progress: bool = True,
) -> tuple[list[Problem], list[Difficulty], CurationReport]:
    """Kept problems (with ``pass_rate`` and ``pass_samples`` added to their record), the verdict
    on every problem, and the report. ``attempts`` maps a problem id to its scored completions."""

    cfg = cfg or DifficultyConfig()
    report = CurationReport("curate difficulty", total=len(problems))
    own = pool is None
    pool = pool or VerifierPool(cfg.workers)
    try:
        jobs = []
        for p in problems:
            tries = list(attempts.get(p.id, ()))
            wrong = [a.answer for a in tries if not a.correct and a.answer]
            future = None
            # Only a problem whose wrong answers could make a majority needs clustering.
            if len(wrong) > cfg.majority * len(tries):
                distinct = len(set(map(normalise_answer, wrong)))
                per_pair = 2 * cfg.math.parse_timeout_s + cfg.math.verify_timeout_s
                limit = 10.0 + distinct * distinct * per_pair
                future = pool.submit(cluster_answers, wrong, cfg.math, timeout_s=limit)
            jobs.append((p, tries, wrong, future))
        kept, details = [], []
        deadline = pool.deadline()  # every clustering done by then (each within its hard limit)
        for p, tries, wrong, future in tqdm(
            jobs, desc="difficulty", unit="problem", file=sys.stderr, disable=not progress
        ):
            labels = _exact_clusters(wrong)
            if future is not None:
                try:
                    labels = pool.result(future, deadline)
                except PoolTaskError as e:  # fall back to exact spelling: flags fewer, never more
                    report.note(f"answer clustering failed ({e.reason}); exact match used")
            answer, count = _majority(wrong, labels)
            n, c = len(tries), sum(bool(a.correct) for a in tries)
            d = Difficulty(
                problem_id=p.id,
                samples=n,
                correct=c,
                pass_rate=c / n if n else 0.0,
                majority_answer=answer,
                majority_count=count,
                flagged=n > 0 and count > cfg.majority * n,
                decision="",
            )
            d.decision = _decide(d, cfg)
            details.append(d)
            if d.flagged:
                report.note("flagged: majority answer differs from the reference")
            if d.decision != "kept":
                report.drop(d.decision)
                continue
            report.keep()
            kept.append(replace(p, meta={**p.meta, "pass_rate": d.pass_rate, "pass_samples": n}))
        return kept, details, report
    finally:
        if own:
            pool.close()


def attempts_from_scored(
    path: str, think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS
) -> dict[str, list[Attempt]]:
    """Pre-scored completions grouped by problem: JSONL lines with ``problem_id`` (or
    ``group_id``, as ``megatron-rl reward`` keeps it), ``completion`` and ``correct`` (or
    ``reason``: ``ok`` is correct); the final answer is extracted from the completion (its
    thinking between ``think_tags``)."""
    out: dict[str, list[Attempt]] = {}
    for where, obj in read_records(path):
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object")
        pid = obj.get("problem_id", obj.get("group_id"))
        if pid is None:
            raise DataError(f"{where}: problem_id: missing (or group_id)")
        if not isinstance(obj.get("completion"), str):
            raise DataError(f"{where}: completion: missing or not a string")
        correct = obj.get("correct", obj.get("reason") == "ok" if "reason" in obj else None)
        if not isinstance(correct, bool):
            raise DataError(f"{where}: correct: expected true/false (or a 'reason'), got {correct!r}")
        # ("answer" in a scored line is the reference, as in `megatron-rl reward` input.)
        answer = extract_answer(obj["completion"], obj.get("task", "math"), think_tags)
        tries = out.setdefault(str(pid), [])
        tries.append(
            Attempt(
                index=len(tries),
                completion=obj["completion"],
                num_tokens=int(obj.get("num_tokens") or 0),
                finish_reason="stop",
                reward=float(obj.get("reward", float(correct))),
                reason=str(obj.get("reason", "ok" if correct else "wrong_answer")),
                correct=correct,
                answer=answer,
            )
        )
    return out
