"""Format filtering of math problems (Magistral: 699k -> 501k before difficulty filtering).

Dropped, with the reason counted:

- ``missing_answer``: no reference answer;
- ``proof``: the statement asks to prove, show or justify something (nothing to compare);
- ``multi_part``: sub-questions -- ``(a) ... (b)``, ``(i) ... (ii)``, ``Part 1 ... Part 2``,
  numbered lines that ask something, two or more question marks outside math -- or an answer in
  several parts (a binary reward would be ambiguous);
- ``multiple_choice_needs_options``: a multiple-choice problem whose statement refers to its
  options ("which of the following ...") or whose right option is "none/all of the above", so it
  cannot stand without them; ``multiple_choice_bad_answer``: the answer names no option;
  ``multiple_choice``: any multiple-choice problem, when conversion is turned off;
- ``textual_answer``: a prose or yes/no answer (words of four or more letters outside LaTeX
  commands and ``\\text{}``); ``unparsable_answer``: the verifier cannot parse the answer, or it
  is not equivalent to itself -- checked with the real math verifier (math-verify), in the
  verifier pool with its hard time limits.

Converted: a multiple-choice problem whose statement stands on its own ("What is 2+3?
(A) 4 (B) 5") becomes a statement problem with the chosen option as its answer ("What is 2+3?",
``5``): harder to guess and checked like any other (``converted_multiple_choice`` note).

Options are recognised as a ``choices`` field, AMC-style ``\\textbf{(A) }``, ``(A) (B) (C)``
inline or ``A.``/``A)`` at line starts (three or more in order for the last two forms, so
``f(A)`` alone is no option list). These are heuristics for scraped data: they err towards
dropping, and the report says how many each rule took.

Code problems pass through untouched (``code_passed_through`` note).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from megatron_rl.config import check_range
from megatron_rl.data.problems import Problem
from megatron_rl.data.report import CurationReport
from megatron_rl.rewards.math import MathConfig, verify_math
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool, max_workers
from megatron_rl.rewards.result import Verdict

__all__ = ["MathFormatConfig", "check_reference", "find_options", "format_filter", "text_reason"]

_PROOF = re.compile(
    r"\b(prove|proves|proving|proof|show that|show why|demonstrate that|"
    r"justify|verify that)\b",
    re.IGNORECASE,
)
_SUB_LETTER = re.compile(r"(?<![\w\\^_])\(([a-h])\)")
_SUB_ROMAN = re.compile(r"(?<![\w\\^_])\((i|ii|iii|iv|v|vi)\)")
_PART = re.compile(r"\bpart\s*\(?([a-d1-4]|i{1,3}|iv)\)?(?![\w])", re.IGNORECASE)
_NUMBERED = re.compile(r"(?m)^\s*([a-d1-9])[.)]\s(.*)$")
_ASKS = re.compile(r"\?|\b(find|compute|determine|calculate|evaluate|what|how|which)\b", re.IGNORECASE)
_MATH_SPANS = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|\\\[.*?\\\]|\\\(.*?\\\)", re.DOTALL)
_REFERS_TO_OPTIONS = re.compile(
    r"which of the following|of the following|which one|which choice|which option|"
    r"among the (options|choices|answers)|(options|choices|answers) (above|below)|"
    r"none of the|all of the",
    re.IGNORECASE,
)
_NOT_A_STATEMENT = re.compile(
    r"none of (the|these)|all of (the|these)|cannot be determined|"
    r"not enough information",
    re.IGNORECASE,
)
_OPTION_FORMS = [  # (pattern, fewest options for the form to count)
    (re.compile(r"\\(?:textbf|text|mathrm|mathbf)\{\s*\(([A-E])\)\s*\}"), 2),
    (re.compile(r"(?<![\w\\^_])\(([A-E])\)"), 3),
    (re.compile(r"(?m)^\s*([A-E])[.):]\s+"), 3),
]
_LETTER = re.compile(r"^\(?\s*([A-E])\s*\)?$")
_WORDS = re.compile(r"[A-Za-z]{4,}")
_YES_NO = re.compile(r"^\s*(yes|no|true|false|none|never|always)\s*\.?\s*$", re.IGNORECASE)


@dataclass(kw_only=True)
class MathFormatConfig:
    """Format-filter settings."""

    convert_multiple_choice: bool = True  # False: drop every multiple-choice problem
    workers: int = 2  # verifier processes for the answer check
    math: MathConfig = field(default_factory=MathConfig)  # the verifier's limits

    def __post_init__(self):
        check_range("workers", self.workers, low=1, high=max_workers())  # this machine runs them


def _strip_wrappers(text: str) -> str:
    """Remove ``$``, ``\\text{..}``-style wrappers and spacing commands around a short answer."""
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\(?:textbf|text|mathrm|mathbf)\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\(?:qquad|quad|,|;|!)|\\\\", " ", text)
    return text.strip().strip("$").strip().rstrip(",;.").strip()


def find_options(problem: Problem) -> tuple[str, dict[str, str]] | None:
    """``(stem, {letter: option text})`` of a multiple-choice problem, or None when it has no
    recognisable options (see the module docstring)."""
    if problem.choices:
        choices = problem.choices
        if isinstance(choices, list):
            choices = {chr(ord("A") + i): c for i, c in enumerate(choices)}
        return problem.problem.strip(), {
            k.strip("() ").upper(): _strip_wrappers(v) for k, v in choices.items()
        }
    text = problem.problem
    for pattern, fewest in _OPTION_FORMS:
        marks = list(pattern.finditer(text))
        # The options are the longest run A, B, C, ... in order.
        run: list[re.Match[str]] = []
        for m in marks:
            if m.group(1) == chr(ord("A") + len(run)):
                run.append(m)
        if len(run) < fewest:
            continue
        options: dict[str, str] = {}
        for m, nxt in zip(run, [*run[1:], None]):
            options[m.group(1)] = _strip_wrappers(text[m.end() : nxt.start() if nxt else len(text)])
        stem = text[: run[0].start()].rstrip()
        stem = stem[:-1].rstrip() if stem.endswith("$") and stem.count("$") % 2 else stem
        return stem, options
    return None


def _multi_part(text: str) -> bool:
    prose = _MATH_SPANS.sub(" ", text)
    letters = {m.group(1) for m in _SUB_LETTER.finditer(prose)}
    romans = {m.group(1) for m in _SUB_ROMAN.finditer(prose)}
    parts = {m.group(1).lower() for m in _PART.finditer(prose)}
    # Numbered lines are sub-questions only when they ask something (else they are conditions).
    numbered = {m.group(1) for m in _NUMBERED.finditer(prose) if _ASKS.search(m.group(2))}
    return (
        {"a", "b"} <= letters
        or {"i", "ii"} <= romans
        or len(parts) >= 2
        or len(numbered) >= 2
        or prose.count("?") >= 2
    )


def text_reason(problem: Problem, cfg: MathFormatConfig) -> tuple[Problem | None, str]:
    """The text-only rules: ``(problem, "ok")``, ``(converted, "converted_multiple_choice")`` or
    ``(None, reason)``. The answer still needs :func:`check_reference` when kept."""
    answer = (problem.answer or "").strip()
    if not _strip_wrappers(answer):
        return None, "missing_answer"
    if _PROOF.search(problem.problem):
        return None, "proof"
    converted = False
    mc = find_options(problem)
    if mc is not None:
        if not cfg.convert_multiple_choice:
            return None, "multiple_choice"
        stem, options = mc
        letter = _LETTER.match(_strip_wrappers(answer))
        if letter:
            if letter.group(1) not in options:
                return None, "multiple_choice_bad_answer"
            answer = options[letter.group(1)]
        if _REFERS_TO_OPTIONS.search(stem) or _NOT_A_STATEMENT.search(answer) or not answer:
            return None, "multiple_choice_needs_options"
        meta = {**problem.meta, "converted_from_multiple_choice": True}
        problem = replace(problem, problem=stem, answer=answer, choices=None, meta=meta)
        converted = True
    if _multi_part(problem.problem) or _SUB_LETTER.search(answer) or ";" in answer:
        return None, "multi_part"
    bare = re.sub(r"\\text\{[^{}]*\}|\\[A-Za-z]+", " ", answer)
    if _YES_NO.match(_strip_wrappers(answer)) or _WORDS.search(bare):
        return None, "textual_answer"
    return problem, "converted_multiple_choice" if converted else "ok"


def check_reference(answer: str, cfg: MathConfig) -> Verdict:
    """Whether the verifier parses ``answer`` and finds it equal to itself (run in a pool
    worker: math-verify's time-outs need a process's main thread)."""
    answer = answer.strip()
    inner = answer[1:-1] if answer.startswith("$") and answer.endswith("$") and len(answer) > 1 else answer
    return verify_math(f"\\boxed{{{inner.strip('$')}}}", answer, cfg)


def format_filter(
    problems: Sequence[Problem],
    cfg: MathFormatConfig | None = None,
    *,
    pool: VerifierPool | None = None,
    progress: bool = True,
) -> tuple[list[Problem], CurationReport]:
    """Apply the rules of the module docstring; kept problems in input order, and the report."""

    cfg = cfg or MathFormatConfig()
    report = CurationReport("curate math-format", total=len(problems))
    own = pool is None
    pool = pool or VerifierPool(cfg.workers)
    timeout = 2 * cfg.math.parse_timeout_s + cfg.math.verify_timeout_s + 10.0
    try:
        staged: list[tuple[Problem | None, str, Future[Verdict] | None]] = []
        for p in problems:
            if p.task != "math":
                staged.append((p, "code_passed_through", None))
                continue
            q, why = text_reason(p, cfg)
            future = pool.submit(check_reference, q.answer, cfg.math, timeout_s=timeout) if q else None
            staged.append((q, why, future))
        kept: list[Problem] = []
        deadline = pool.deadline()  # every check done by then (each within its hard limit)
        for q, why, future in tqdm(
            staged, desc="math-format", unit="problem", file=sys.stderr, disable=not progress
        ):
            if q is None:
                report.drop(why)
                continue
            if future is not None:
                try:
                    verdict = pool.result(future, deadline)
                except PoolTaskError as e:
                    verdict = Verdict(False, 0.0, "unparsable_answer", e.detail)
                if not verdict.correct:
                    report.drop("unparsable_answer")
                    continue
            if why != "ok":
                report.note(why)
            report.keep()
            kept.append(q)
        return kept, report
    finally:
        if own:
            pool.close()
