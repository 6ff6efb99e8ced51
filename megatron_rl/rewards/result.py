"""What a verifier returns, and the vocabulary of reasons a reward can carry."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["REASONS", "REASON_LABEL", "RewardResult", "Verdict"]

#: Every reason the built-in verifiers and the pool give a sample. ``ok`` means fully correct. A
#: custom reward (``rewards/custom.py``) may return labels of its own (``wrong_unit``), and its
#: failures use ``verifier_error`` / ``timeout`` / ``worker_*`` with a ``custom:`` detail.
#: What any reason must look like (a custom reward's own labels too): a short label that runs
#: count per value, never a message (free text goes in ``detail``).
REASON_LABEL = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

REASONS = (
    "ok",
    "format_error",  # template not followed (no <think> start, not exactly one </think>, ...)
    "no_answer",  # format fine but nothing to check (empty box / empty code block)
    "unparsable_answer",  # the answer could not be parsed as math
    "wrong_answer",  # checked and wrong (math) / a test's output differs (code)
    "compile_error",  # C++ did not compile (or compile exceeded its limit)
    "runtime_error",  # non-zero exit, exception, killed by a signal other than the limits below
    "timeout",  # a test ran past its CPU or wall-clock limit
    "memory",  # a test ran out of its memory limit
    "output_limit",  # a test wrote more than the output limit
    "sandbox_error",  # the sandbox itself failed (never the program's fault)
    "verifier_error",  # the verifier raised; the sample is scored as failed
    "worker_timeout",  # the verifier pool killed a worker stuck past the task's hard limit
    "worker_crash",  # the verifier process died
    "bad_input",  # the input record is malformed (CLI --skip-bad)
)


@dataclass
class Verdict:
    """Outcome of one correctness check (math or code)."""

    correct: bool
    fraction: float = 0.0  # share of checks passed: 1.0/0.0 for math, passed/total tests for code
    reason: str = "ok"  # one of REASONS
    detail: str = ""  # human-readable, for logs (first failing test, parser message, ...)

    def __post_init__(self):
        if self.reason not in REASONS:
            raise ValueError(f"unknown reason {self.reason!r}; known: {', '.join(REASONS)}")


@dataclass
class RewardResult:
    """A reward: the total, its parts (format, correctness, length, language) and the reason."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    reason: str = "ok"
    detail: str = ""
    correct: bool = False
    format_ok: bool = False
    info: dict = field(default_factory=dict)  # e.g. the detected language of each span

    def to_json(self) -> dict:
        return {
            "reward": self.reward,
            "parts": self.parts,
            "reason": self.reason,
            "detail": self.detail,
            "correct": self.correct,
            "format_ok": self.format_ok,
            **({"info": self.info} if self.info else {}),
        }
