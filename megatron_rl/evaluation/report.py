"""From scored samples to an evaluation report: per-problem metrics (answers clustered by the math
verifier for maj@k), then, in the output folder,

- ``report.json``: settings, the summary (overall, per task, per language) and every problem;
- ``report.md``: the same summary as Markdown tables;
- ``samples.jsonl``: every sampled completion with its score;
- ``pass_at_k.png`` (per task, and per language when there are several), ``lengths.png``
  (correct vs incorrect) and ``languages.png`` (pass@1 per language, when there are several).

Every file is written atomically.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from megatron_rl.data.difficulty import cluster_answers, normalise_answer
from megatron_rl.data.problems import Problem
from megatron_rl.evaluation import plots
from megatron_rl.evaluation.metrics import ProblemEval, aggregate, evaluate_problem
from megatron_rl.fileio import atomic_write_json, atomic_write_text, write_jsonl
from megatron_rl.rewards.language import detect_language
from megatron_rl.rewards.math import MathConfig
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool

if TYPE_CHECKING:
    from megatron_rl.data.sampling import Attempt
    from megatron_rl.fileio import JsonValue

__all__ = ["evaluate", "markdown", "problem_language", "write_report"]


def problem_language(problem: Problem) -> str:
    """The statement's language: its ``lang`` field, else fastText's guess, else ``und``."""
    if problem.lang:
        return problem.lang

    lang, _ = detect_language(problem.problem)
    return lang or "und"


def evaluate(
    problems: Sequence[Problem],
    attempts: Mapping[str, Sequence],
    ks: Sequence[int],
    *,
    pool: VerifierPool,
    math_cfg: MathConfig | None = None,
    progress: bool = True,
) -> list[ProblemEval]:
    """:class:`ProblemEval` of every problem; wrong math answers are clustered in ``pool``."""

    math_cfg = math_cfg or MathConfig()
    jobs = []
    for p in problems:
        tries = attempts.get(p.id, [])
        wrong = [a.answer for a in tries if not a.correct and a.answer]
        future = None
        if p.task == "math" and len(set(map(normalise_answer, wrong))) > 1:
            limit = 10.0 + len(wrong) ** 2 * (2 * math_cfg.parse_timeout_s + math_cfg.verify_timeout_s)
            future = pool.submit(cluster_answers, wrong, math_cfg, timeout_s=limit)
        jobs.append((p, tries, wrong, future))
    results = []
    deadline = pool.deadline()  # every clustering done by then (each within its hard limit)
    for p, tries, wrong, future in tqdm(
        jobs, desc="metrics", unit="problem", file=sys.stderr, disable=not progress
    ):
        wrong_labels = [0] * len(wrong)
        if future is not None:
            try:
                wrong_labels = pool.result(future, deadline)
            except PoolTaskError:  # exact spelling instead: splits votes, never merges wrongly
                ids: dict[str, int] = {}
                wrong_labels = [ids.setdefault(normalise_answer(a), len(ids)) for a in wrong]
        # Label 0: the reference (every correct attempt); wrong clusters from 1; None: no answer.
        it = iter(wrong_labels)
        labels = [0 if a.correct else (1 + next(it) if a.answer else None) for a in tries]
        results.append(evaluate_problem(p.id, p.task, problem_language(p), tries, ks, labels))
    return results


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _table(groups: Mapping[str, Mapping[str, JsonValue]], ks: Sequence[int], n: int) -> list[str]:
    head = ["", "problems", *(f"pass@{k}" for k in ks), f"maj@{n}", "mean length", "truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in groups.items():
        row = [
            name,
            str(s["problems"]),
            *(_pct(s["pass_at"].get(str(k))) for k in ks),
            _pct(s["maj"]),
            f"{s['length']['all']['mean']:.0f}",
            _pct(s["truncated_share"]),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(summary: Mapping[str, JsonValue], settings: Mapping[str, JsonValue], ks: Sequence[int]) -> str:
    """The report as Markdown (percentages; maj over all samples)."""
    n = settings.get("k", ks[-1])
    lines = ["# Evaluation report", ""]
    lines += [f"- **{k}**: {v}" for k, v in settings.items()]
    lines += ["", "## Overall", "", *_table({"all": summary["overall"]}, ks, n)]
    lines += ["", "## Per task", "", *_table(summary["by_task"], ks, n)]
    lines += ["", "## Per language", "", *_table(summary["by_lang"], ks, n)]
    length = summary["overall"]["length"]
    lines += [
        "",
        "## Completion length (tokens)",
        "",
        "| | count | mean | median | p90 | min | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("all", "correct", "incorrect"):
        s = length[name]
        lines.append(
            f"| {name} | {s['count']} | {s['mean']:.1f} | {s['median']:.0f} | "
            f"{s['p90']:.0f} | {s['min']} | {s['max']} |"
        )
    lines += ["", "## Reasons", "", "| reason | samples |", "|---|---|"]
    lines += [f"| {r} | {c} |" for r, c in summary["overall"]["reasons"].items()]
    lines += [
        "",
        "pass@k: unbiased estimator (Chen et al., 2021) over all samples; "
        f"maj@{n}: majority answer over all samples (math only).",
        "",
    ]
    return "\n".join(lines)


#: The files :func:`write_report` writes into its folder (what the command line checks its inputs
#: against before it starts).
REPORT_FILES = ("report.json", "report.md", "samples.jsonl", "pass_at_k.png", "lengths.png", "languages.png")


def write_report(
    out_dir: str | Path,
    problems: Sequence[Problem],
    attempts: Mapping[str, Sequence[Attempt]],
    results: Sequence[ProblemEval],
    ks: Sequence[int],
    settings: Mapping[str, JsonValue],
) -> dict[str, JsonValue]:
    """Write the files of the module docstring into ``out_dir``; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = aggregate(results, ks)
    atomic_write_json(
        out / "report.json",
        {
            "settings": dict(settings),
            "ks": list(ks),
            "summary": summary,
            "problems": [r.to_json() for r in results],
        },
    )
    atomic_write_text(out / "report.md", markdown(summary, settings, ks))
    write_jsonl(
        out / "samples.jsonl",
        ({"problem_id": p.id, **a.to_json()} for p in problems for a in attempts.get(p.id, [])),
    )

    def curve(s: JsonValue) -> list[float]:  # nan where some problem has fewer than k samples
        return [s["pass_at"].get(str(k), float("nan")) for k in ks]

    curves = {f"task {name}": curve(s) for name, s in summary["by_task"].items()}
    if len(summary["by_lang"]) > 1:
        curves.update({f"lang {name}": curve(s) for name, s in summary["by_lang"].items()})
        plots.language_bars(
            {name: s["pass_at"].get("1", 0.0) for name, s in summary["by_lang"].items()},
            out / "languages.png",
        )
    plots.pass_at_k_curve(ks, curves, out / "pass_at_k.png")
    plots.length_histogram(
        [n for r in results for n, ok in zip(r.lengths, r.correct_mask) if ok],
        [n for r in results for n, ok in zip(r.lengths, r.correct_mask) if not ok],
        out / "lengths.png",
    )
    return summary
