"""The whole reward: format, correctness, length penalty, language bonus.

    total = 0                                              if the format check fails
          = format + correct * (1 | fraction) + length + language   otherwise

with Magistral's values as defaults: format 0.1, correct 0.9 (binary: all tests must pass;
proportional as an option), length penalty down to -0.1 between ``l_max - l_cache`` and
``l_max``, language +0.1 when problem, thinking and answer share one language.

:func:`score` is the fixed-signature verifier entry point that pool workers run;
:func:`score_many` spreads a batch over a :class:`VerifierPool` and always returns one
:class:`RewardResult` per input, in order -- a stuck or crashed verifier scores its sample 0 with
the reason (``worker_timeout`` / ``worker_crash`` / ``verifier_error``).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.config import ConfigFieldError, check_range
from megatron_rl.rewards.code import CodeConfig, ensure_pch, extract_code_block, verify_code
from megatron_rl.rewards.format import check_format
from megatron_rl.rewards.language import language_consistent
from megatron_rl.rewards.length import length_penalty
from megatron_rl.rewards.math import MathConfig, verify_math
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool
from megatron_rl.rewards.result import RewardResult, Verdict

__all__ = [
    "RewardConfig",
    "RewardInput",
    "group_seed",
    "hard_timeout_s",
    "prepare_verifiers",
    "score",
    "score_many",
]


@dataclass(kw_only=True)
class RewardConfig:
    """Reward weights and limits (defaults: the paper's)."""

    format_reward: float = 0.1  # for a well-formed completion
    correct_reward: float = 0.9  # for a correct answer (times the fraction of tests, if partial)
    language_reward: float = 0.1  # when problem, thinking and answer share one language
    length_penalty: float = 0.1  # largest length penalty (reached at l_max)
    l_max: int = 24576  # completion tokens at which the full penalty applies
    l_cache: int = 8192  # width of the linear ramp before l_max
    workers: int = 2  # verifier processes
    task_timeout_s: float = 0.0  # hard wall-clock limit per sample; 0 = derived from the limits
    math: MathConfig = field(default_factory=MathConfig)
    code: CodeConfig = field(default_factory=CodeConfig)

    def __post_init__(self):
        for name in (
            "format_reward",
            "correct_reward",
            "language_reward",
            "length_penalty",
            "task_timeout_s",
        ):
            check_range(name, getattr(self, name), low=0.0)
        check_range("l_max", self.l_max, low=1)
        if not 0 <= self.l_cache <= self.l_max:
            raise ConfigFieldError("l_cache", f"must be in [0, l_max={self.l_max}], got {self.l_cache}")
        check_range("workers", self.workers, low=1)


@dataclass(kw_only=True)
class RewardInput:
    """One sample to score."""

    problem: str
    completion: str
    task: Literal["math", "code"]
    answer: str | None = None  # math reference
    tests: list[dict[str, Any]] | None = None  # code tests
    language: str | None = None  # code: the language the problem asks for (python / cpp)
    group_id: str | int | None = None  # completions of one group draw the same code tests
    num_tokens: int | None = None  # completion length in tokens (length penalty); None = none

    def __post_init__(self):
        if self.task == "math" and self.answer is None:
            raise ValueError("a math sample needs 'answer'")
        if self.task == "code" and not self.tests:
            raise ValueError("a code sample needs a non-empty 'tests' list")
        if self.task not in ("math", "code"):
            raise ValueError(f"task must be 'math' or 'code', got {self.task!r}")


def group_seed(inp: RewardInput) -> int:
    """Seed of the code-test draw: the same for every completion of a group (or of a problem)."""
    key = str(inp.group_id) if inp.group_id is not None else inp.problem
    return zlib.crc32(key.encode())


def _correctness(inp: RewardInput, answer: str, cfg: RewardConfig) -> Verdict:
    # __post_init__ refuses a math sample without an answer and a code sample without tests;
    # RewardInput is not frozen, so these say so again rather than fail deeper in.
    if inp.task == "math":
        if inp.answer is None:
            raise ValueError("a math sample needs 'answer'")
        return verify_math(answer, inp.answer, cfg.math)
    block_lang, code = extract_code_block(answer)
    if code is None or not code.strip():
        return Verdict(False, 0.0, "no_answer", "empty code block")
    if inp.language and block_lang != inp.language:
        return Verdict(
            False, 0.0, "wrong_answer", f"code block is {block_lang!r}, the problem asks for {inp.language!r}"
        )
    if inp.tests is None:
        raise ValueError("a code sample needs a non-empty 'tests' list")
    return verify_code(code, block_lang, inp.tests, cfg.code, seed=group_seed(inp))


def score(inp: RewardInput, cfg: RewardConfig) -> RewardResult:
    """Score one completion (runs in a verifier worker; see the module docstring)."""
    parsed, why = check_format(inp.completion, inp.task)
    if parsed is None:
        return RewardResult(
            0.0, {"format": 0.0, "correct": 0.0, "length": 0.0, "language": 0.0}, "format_error", why
        )
    verdict = _correctness(inp, parsed.answer, cfg)
    share = verdict.fraction if cfg.code.partial_credit and inp.task == "code" else float(verdict.correct)
    consistent, langs = language_consistent(inp.problem, parsed.thinking, parsed.answer)
    parts = {
        "format": cfg.format_reward,
        "correct": cfg.correct_reward * share,
        "length": (
            length_penalty(inp.num_tokens, cfg.l_max, cfg.l_cache, cfg.length_penalty)
            if inp.num_tokens is not None
            else 0.0
        ),
        "language": cfg.language_reward if consistent else 0.0,
    }
    return RewardResult(
        sum(parts.values()),
        parts,
        verdict.reason,
        verdict.detail,
        correct=verdict.correct,
        format_ok=True,
        info={"languages": langs},
    )


def hard_timeout_s(inp: RewardInput, cfg: RewardConfig) -> float:
    """Wall-clock limit after which the pool kills the worker scoring ``inp``."""
    if cfg.task_timeout_s:
        return cfg.task_timeout_s
    if inp.task == "math":  # two parses and one compare, each bounded by SIGALRM, plus slack
        return 2 * cfg.math.parse_timeout_s + cfg.math.verify_timeout_s + 10.0
    n = min(len(inp.tests or ()), cfg.code.tests_per_problem)
    return cfg.code.compile_timeout_s + n * (math.ceil(cfg.code.test_timeout_s) + 2) + 10.0


def prepare_verifiers(inputs: list[RewardInput], cfg: RewardConfig) -> None:
    """One-off work before scoring: build the precompiled C++ header (~5 s, once per compiler and
    flag set) in the caller, so it is not charged to the first C++ sample's hard time limit."""
    if any(i.task == "code" and i.language == "cpp" for i in inputs):
        ensure_pch(cfg.code)


def _failed(reason: str, detail: str) -> RewardResult:
    return RewardResult(0.0, {"format": 0.0, "correct": 0.0, "length": 0.0, "language": 0.0}, reason, detail)


def score_many(
    inputs: list[RewardInput], cfg: RewardConfig, pool: VerifierPool | None = None
) -> list[RewardResult]:
    """Score a batch in the pool (one is started and stopped when not given); input order."""
    prepare_verifiers(inputs, cfg)
    own = pool is None
    pool = pool or VerifierPool(cfg.workers)
    try:
        futures = [pool.submit(score, inp, cfg, timeout_s=hard_timeout_s(inp, cfg)) for inp in inputs]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except PoolTaskError as e:
                out.append(_failed(e.reason, e.detail))
        return out
    finally:
        if own:
            pool.close()
