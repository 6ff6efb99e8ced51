"""Held-out pass@1 during a run: ``k`` samples of each held-out problem through the run's fleet,
scored by its verifier pool, as one record of ``eval.jsonl``.

Every sample is accounted for, and the evaluation always ends: a sample whose verifier fails or
runs past its limits scores 0 with the reason (``timeout``, ``verifier_error``, ``worker_timeout``,
or ``scoring_timeout`` when its score is not in by the pool's deadline); with a ``deadline`` (the
run's ``run.time_limit_min``) the evaluation stops there, its unscored samples count as
``time_limit`` and those never generated as ``not_generated``, and the record says ``partial``.
pass@1 is the mean correctness of the samples generated (a failed one counts as wrong);
``pass@1_se`` its standard error over problems (the spread of the per-problem means over the
square root of the number of problems: the samples of one problem are not independent draws).

    record = held_out_pass_at_1(fleet, pool, tok, problems, sampling, reward, label="after")
    record["pass@1"], record["reasons"]          # e.g. 0.75, {"ok": 6, "timeout": 2}
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_rl.data.sampling import SamplingConfig, sample_and_score

if TYPE_CHECKING:
    from megatron_rl.data.problems import Problem
    from megatron_rl.fileio import JsonValue
    from megatron_rl.rewards.compose import RewardConfig
    from megatron_rl.rewards.pool import VerifierPool

__all__ = ["describe", "held_out_pass_at_1"]


def held_out_pass_at_1(
    generator,
    pool: VerifierPool,
    tokenizer,
    problems: Sequence[Problem],
    sampling: SamplingConfig,
    reward: RewardConfig,
    *,
    label: str,
    progress: bool = True,
    deadline: float | None = None,
) -> dict[str, JsonValue]:
    """One evaluation record (see the module docstring): ``label``, ``pass@1`` (None when no
    sample was generated), ``pass@1_se``, ``format_rate``, ``length/mean``, ``problems``, ``samples`` (generated
    and scored), ``reasons`` (samples per reason), ``seconds``, and ``partial`` when ``deadline``
    (``time.monotonic()``) cut it short."""
    t0 = time.monotonic()
    attempts = sample_and_score(
        problems,
        generator,
        tokenizer,
        sampling,
        reward,
        pool=pool,
        progress=progress,
        desc=f"eval {label}",
        deadline=deadline,
    )
    flat = [a for v in attempts.values() for a in v]
    expected = sampling.k * len(problems)
    reasons = Counter(a.reason for a in flat)
    if len(flat) < expected:
        reasons["not_generated"] = expected - len(flat)
    n = len(flat)
    means = [sum(a.correct for a in v) / len(v) for v in attempts.values() if v]
    record: dict[str, JsonValue] = {
        "label": label,
        "pass@1": sum(a.correct for a in flat) / n if n else None,
        "pass@1_se": statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else None,
        "format_rate": sum(a.reason != "format_error" for a in flat) / n if n else None,
        "length/mean": sum(a.num_tokens for a in flat) / n if n else None,
        "problems": len(attempts),
        "samples": n,
        "reasons": dict(sorted(reasons.items())),
        "seconds": round(time.monotonic() - t0, 3),
    }
    if reasons["time_limit"] or reasons["not_generated"]:
        record["partial"] = True
    return record


def describe(record: dict[str, JsonValue]) -> str:
    """One line for the console: ``held-out pass@1 0.750 (format 1.00, length 14, 12 samples;
    failed: timeout 2, worker_timeout 2)``, and whether the time limit cut it short."""
    fmt = lambda key, spec: "-" if record.get(key) is None else format(record[key], spec)
    reasons = record.get("reasons") or {}
    failed = {k: v for k, v in reasons.items() if k not in ("ok", "wrong_answer")}
    return (
        f"held-out pass@1 {fmt('pass@1', '.3f')} (format {fmt('format_rate', '.2f')}, "
        f"length {fmt('length/mean', '.0f')}, {record.get('samples')} samples"
        + (f"; failed: {', '.join(f'{k} {v}' for k, v in failed.items())}" if failed else "")
        + ("; cut short by run.time_limit_min" if record.get("partial") else "")
        + ")"
    )
