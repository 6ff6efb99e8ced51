"""Evaluation metrics over n scored samples per problem.

- pass@1 is the mean correctness over all n samples ("pass@1 averaged over k"); pass@k for k <= n
  is Chen et al. (2021)'s unbiased estimator ``1 - C(n-c, k) / C(n, k)`` for c correct samples,
  computed as the product ``1 - prod_{i=n-c+1..n} (1 - k/i)`` (no huge binomials, no
  cancellation: every factor lies in [0, 1]);
- maj@n: the answer most samples agree on (the math verifier decides which answers are the same)
  is the one graded; ties count as the expected score of breaking them uniformly at random. Code
  completions are not voted on (maj is None);
- length statistics of completions (tokens): all, correct, incorrect, and the share cut at the
  token budget (finish reason ``length``).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = [
    "ProblemEval",
    "aggregate",
    "default_ks",
    "evaluate_problem",
    "length_stats",
    "majority_score",
    "pass_at_k",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct)
    is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_score(labels: Sequence[int | None], correct_label: int | None) -> float:
    """Score of the majority vote: 1 if the largest cluster is the correct one, 1/t if it ties
    with t-1 others, 0 otherwise. ``None`` labels (no answer) do not vote."""
    votes = Counter(label for label in labels if label is not None)
    if not votes or correct_label is None:
        return 0.0
    top = max(votes.values())
    leaders = [label for label, n in votes.items() if n == top]
    return (correct_label in leaders) / len(leaders)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@dataclass(kw_only=True)
class ProblemEval:
    """One problem's results."""

    problem_id: str
    task: str
    lang: str  # natural language of the statement
    samples: int
    correct: int
    pass_at: dict[int, float]  # k -> unbiased pass@k
    maj: float | None  # maj@samples (None for code)
    lengths: list[int] = field(default_factory=list)  # completion tokens per sample
    correct_mask: list[bool] = field(default_factory=list)
    truncated: int = 0  # samples cut at the token budget
    reasons: Counter = field(default_factory=Counter)

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "problem_id": self.problem_id,
            "task": self.task,
            "lang": self.lang,
            "samples": self.samples,
            "correct": self.correct,
            "pass_at": {str(k): v for k, v in self.pass_at.items()},
            "maj": self.maj,
            "mean_length": statistics.fmean(self.lengths) if self.lengths else 0.0,
            "truncated": self.truncated,
            "reasons": dict(self.reasons),
        }


def evaluate_problem(
    problem_id: str,
    task: str,
    lang: str,
    attempts: Sequence,
    ks: Sequence[int],
    labels: Sequence[int | None] | None = None,
) -> ProblemEval:
    """Metrics of one problem from its scored attempts (``.correct``, ``.num_tokens``,
    ``.finish_reason``, ``.reason``). ``labels``: a cluster label per attempt (None: no answer),
    where every correct attempt carries the same label -- needed for maj (math only)."""
    n = len(attempts)
    c = sum(bool(a.correct) for a in attempts)
    maj = None
    if task == "math" and labels is not None:
        right = {lab for a, lab in zip(attempts, labels) if a.correct}
        if len(right) > 1:
            raise ValueError(f"{problem_id}: correct attempts must share one cluster label, got {right}")
        maj = majority_score(labels, next(iter(right), None))
    return ProblemEval(
        problem_id=problem_id,
        task=task,
        lang=lang,
        samples=n,
        correct=c,
        pass_at={k: pass_at_k(n, c, k) for k in ks if k <= n},
        maj=maj,
        lengths=[a.num_tokens for a in attempts],
        correct_mask=[bool(a.correct) for a in attempts],
        truncated=sum(a.finish_reason == "length" for a in attempts),
        reasons=Counter(a.reason for a in attempts),
    )


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """mean / median / p90 / min / max of completion lengths (zeros when empty)."""
    if not lengths:
        return {"count": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "min": 0, "max": 0}
    ordered = sorted(lengths)
    return {
        "count": len(ordered),
        "mean": statistics.fmean(ordered),
        "median": float(statistics.median(ordered)),
        "p90": float(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]),
        "min": ordered[0],
        "max": ordered[-1],
    }


def _summary(results: Sequence[ProblemEval], ks: Sequence[int]) -> dict[str, JsonValue]:
    majs = [r.maj for r in results if r.maj is not None]
    every = [n for r in results for n in r.lengths]
    right = [n for r in results for n, ok in zip(r.lengths, r.correct_mask) if ok]
    wrong = [n for r in results for n, ok in zip(r.lengths, r.correct_mask) if not ok]
    samples = sum(r.samples for r in results)
    reasons: Counter[str] = Counter()
    for r in results:
        reasons.update(r.reasons)
    return {
        "problems": len(results),
        "samples": samples,
        "pass_at": {
            str(k): statistics.fmean(r.pass_at[k] for r in results)
            for k in ks
            if results and all(k in r.pass_at for r in results)
        },
        "maj": statistics.fmean(majs) if majs else None,
        "maj_problems": len(majs),
        "length": {
            "all": length_stats(every),
            "correct": length_stats(right),
            "incorrect": length_stats(wrong),
        },
        "truncated_share": sum(r.truncated for r in results) / samples if samples else 0.0,
        "reasons": dict(reasons.most_common()),
    }


def aggregate(results: Sequence[ProblemEval], ks: Sequence[int]) -> dict[str, JsonValue]:
    """Overall summary, and the same per task and per language (the JSON of ``report.json``)."""
    out: dict[str, JsonValue] = {"overall": _summary(results, ks), "by_task": {}, "by_lang": {}}
    for key, attr in (("by_task", "task"), ("by_lang", "lang")):
        groups: dict[str, list[ProblemEval]] = {}
        for r in results:
            groups.setdefault(getattr(r, attr), []).append(r)
        out[key] = {name: _summary(group, ks) for name, group in sorted(groups.items())}
    return out
