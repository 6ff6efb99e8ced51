"""The math verifier: the last ``\\boxed{}`` of the answer against the reference, via math-verify.

math-verify parses LaTeX into SymPy and compares with tolerance for equivalent forms (fractions
and decimals, radicals, intervals, sets, matrices, units and ``\\text{}``, ``\\dfrac``, percentages,
``x = 3`` against ``3``). It needs the gold answer inside ``$...$``; this module wraps it.

Bounds: the extracted answer is rejected before parsing when it is longer than
``max_answer_chars`` or its braces nest deeper than ``max_brace_depth`` (deep nesting overflows
the LaTeX parser's recursion); math-verify's own parse and compare time-outs are passed through
(they use SIGALRM, so they work in a process's main thread -- which is why verification runs in
the process pool, never in threads). Work that sits inside one C call (``9^{9^{9}}``) cannot be
interrupted by a signal: the pool's hard wall-clock limit per task is the last line of defence.

Verdict cache: a group's samples often box the same string (the right answer most of all, once
the policy learns it), and a prompt comes back every epoch. Each process keeps the verdicts of the
last ``verdict_cache`` distinct ``(boxed answer, reference, float_rounding)`` triples, so a repeat
costs a dictionary lookup instead of two parses and a SymPy comparison. Verification is a pure
function of that triple except for time-outs, which depend on the machine's load: a timed-out
verdict, or a reference that did not parse (its parse may have timed out), is never cached. The cache
holds and returns copies, so a caller that edits its verdict does not edit the cache.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from math import gcd

from megatron_rl.config import check_range
from megatron_rl.rewards.format import last_boxed
from megatron_rl.rewards.result import Verdict

__all__ = ["MathConfig", "brace_depth", "clear_verdict_cache", "verify_math", "warm_up"]


@dataclass(kw_only=True)
class MathConfig:
    """Limits of the math verifier."""

    parse_timeout_s: int = 3  # math-verify parsing time-out per expression (SIGALRM, whole seconds)
    verify_timeout_s: int = 3  # math-verify comparison time-out (SIGALRM, whole seconds)
    max_answer_chars: int = 2000  # longer boxed answers are rejected unparsed
    max_brace_depth: int = 40  # deeper brace nesting is rejected unparsed
    float_rounding: int = 6  # decimals kept when comparing floats
    verdict_cache: int = 4096  # distinct (answer, reference) verdicts kept per process; 0 = off

    def __post_init__(self):
        check_range("parse_timeout_s", self.parse_timeout_s, low=1)
        check_range("verify_timeout_s", self.verify_timeout_s, low=1)
        check_range("max_answer_chars", self.max_answer_chars, low=1)
        check_range("max_brace_depth", self.max_brace_depth, low=1)
        check_range("float_rounding", self.float_rounding, low=0)
        check_range("verdict_cache", self.verdict_cache, low=0)


def brace_depth(text: str) -> int:
    """Deepest ``{`` nesting in ``text``."""
    depth = best = 0
    for c in text:
        if c == "{":
            depth += 1
            best = max(best, depth)
        elif c == "}":
            depth -= 1
    return best


class _TimeoutLog(logging.Handler):
    """Records math-verify's time-out warnings (it logs them and returns False)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.timed_out = False

    def emit(self, record: logging.LogRecord) -> None:
        self.timed_out |= "timeout" in record.getMessage().lower()


@contextmanager
def _watch_timeouts():
    loggers = [logging.getLogger(n) for n in ("math_verify.grader", "math_verify.parser")]
    handler = _TimeoutLog()
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False  # the reason is reported in the verdict; keep worker logs quiet
    try:
        yield handler
    finally:
        for lg, (propagate, _) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate = propagate


_REPEATING = re.compile(r"(-?)(\d*)\.(\d*)\\overline\{(\d+)\}")


def _repeating_decimals(text: str) -> str:
    """``0.1\\overline{6}`` -> ``\\frac{1}{6}``: math-verify does not read repeating decimals.

    For ``I.A(B)`` with ``A`` of ``a`` digits and ``B`` of ``b`` digits, the value is
    ``(IAB - IA) / (10^a (10^b - 1))``.
    """

    def repl(m: re.Match) -> str:
        sign, whole, fixed, rep = m.group(1), m.group(2) or "0", m.group(3), m.group(4)
        num = int(whole + fixed + rep) - int(whole + fixed)
        den = 10 ** len(fixed) * (10 ** len(rep) - 1)
        g = gcd(num, den)
        return f"{sign}\\frac{{{num // g}}}{{{den // g}}}"

    return _REPEATING.sub(repl, text)


def _as_gold(reference: str) -> str:
    ref = reference.strip()
    if ref.startswith("$$") and ref.endswith("$$") and len(ref) > 4:
        ref = ref[2:-2]
    elif ref.startswith("$") and ref.endswith("$") and len(ref) > 2:
        ref = ref[1:-1]
    return f"${_repeating_decimals(ref)}$"


_VERDICTS: OrderedDict[tuple[str, str, int], Verdict] = OrderedDict()  # this process's cache


def clear_verdict_cache() -> None:
    """Forget this process's cached verdicts (e.g. to time a batch without earlier ones)."""
    _VERDICTS.clear()


def verify_math(answer: str, reference: str, cfg: MathConfig | None = None) -> Verdict:
    """Check the last ``\\boxed{}`` of ``answer`` (the answer part of a completion) against
    ``reference`` (a LaTeX or plain answer, with or without ``$``)."""
    cfg = cfg or MathConfig()
    boxed = last_boxed(answer)
    if boxed is None or not boxed.strip():
        return Verdict(False, 0.0, "no_answer", "no \\boxed{} with content in the answer part")
    key = (boxed, reference, cfg.float_rounding)
    cached = _VERDICTS.get(key) if cfg.verdict_cache else None
    if cached is not None:
        _VERDICTS.move_to_end(key)
        return dataclasses.replace(cached)
    verdict = _verify_boxed(boxed, reference, cfg)
    if cfg.verdict_cache and verdict.reason not in ("timeout", "verifier_error"):  # load-dependent
        _VERDICTS[key] = dataclasses.replace(verdict)
        while len(_VERDICTS) > cfg.verdict_cache:
            _VERDICTS.popitem(last=False)
    return verdict


def _verify_boxed(boxed: str, reference: str, cfg: MathConfig) -> Verdict:
    """:func:`verify_math` on the extracted answer, uncached."""
    from math_verify import (  # imported here: heavy, and only needed in workers  # lazy: heavy (SymPy, ANTLR); loaded in verifier workers only
        parse,
        verify,
    )

    if len(boxed) > cfg.max_answer_chars:
        return Verdict(
            False,
            0.0,
            "unparsable_answer",
            f"boxed answer has {len(boxed)} characters (limit {cfg.max_answer_chars})",
        )
    if brace_depth(boxed) > cfg.max_brace_depth:
        return Verdict(False, 0.0, "unparsable_answer", f"braces nest deeper than {cfg.max_brace_depth}")
    with _watch_timeouts() as log:
        gold = parse(_as_gold(reference), parsing_timeout=cfg.parse_timeout_s)
        if not gold:
            return Verdict(False, 0.0, "verifier_error", f"reference answer {reference!r} cannot be parsed")
        pred = parse(f"$\\boxed{{{_repeating_decimals(boxed)}}}$", parsing_timeout=cfg.parse_timeout_s)
        if not pred:
            reason = "timeout" if log.timed_out else "unparsable_answer"
            return Verdict(False, 0.0, reason, f"cannot parse {boxed[:80]!r}")
        ok = verify(gold, pred, float_rounding=cfg.float_rounding, timeout_seconds=cfg.verify_timeout_s)
    if log.timed_out and not ok:
        return Verdict(False, 0.0, "timeout", f"comparing {boxed[:80]!r} with the reference timed out")
    if ok:
        return Verdict(True, 1.0, "ok")
    return Verdict(False, 0.0, "wrong_answer", f"{boxed[:80]!r} is not {reference[:80]!r}")


# One of each kind of answer the parser and SymPy build something for on first use.
_WARM_UP = (
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{x = 3}", "3"),
    (r"\boxed{(1, 2]}", "(1,2]"),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
)


def warm_up() -> None:
    """Import math-verify and verify a few answers, so that a verifier process's first sample does
    not pay for the import (~0.6 s), the grammar and SymPy's first calls (~0.1 s) inside its time
    limit. Pass it as ``VerifierPool(warmup=warm_up)``."""
    for answer, reference in _WARM_UP:
        verify_math(answer, reference)
