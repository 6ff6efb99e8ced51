"""The whole reward: format, correctness, length penalty, language bonus.

    total = 0                                              if the format check fails
          = format + correct * (1 | fraction) + length + language   otherwise

with Magistral's values as defaults: format 0.1, correct 0.9 (binary: all tests must pass;
proportional as an option), length penalty down to -0.1 between ``l_max - l_cache`` and
``l_max``, language +0.1 when problem, thinking and answer share one language.

``reward.custom`` (:mod:`megatron_rl.rewards.custom`) plugs in a function of your own: its score
times ``custom_weight`` is the ``custom`` part, which replaces the correctness part
(``custom_mode: replace``, the default) or is added beside it (``add``). The format check still
comes first and a failure still scores 0, and the length and language parts stay, as in the paper.

:func:`score` is the fixed-signature verifier entry point that pool workers run;
:func:`score_many` spreads a batch over a :class:`VerifierPool` and always returns one
:class:`RewardResult` per input, in order -- a stuck or crashed verifier scores its sample 0 with
the reason (``worker_timeout`` / ``worker_crash`` / ``verifier_error``).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal
from urllib.parse import urlsplit

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.rewards.code import CodeConfig, ensure_pch, extract_code_block, verify_code
from megatron_rl.rewards.custom import CustomScore, call_custom, resolve, warm_up
from megatron_rl.rewards.format import check_format, check_think_tags
from megatron_rl.rewards.language import language_consistent
from megatron_rl.rewards.length import length_penalty
from megatron_rl.rewards.math import MathConfig, verify_math
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool
from megatron_rl.rewards.result import RewardResult, Verdict
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS

__all__ = [
    "RewardConfig",
    "RewardInput",
    "failed_result",
    "group_seed",
    "hard_timeout_s",
    "prepare_verifiers",
    "problem_record",
    "score",
    "score_many",
    "split_verifier_url",
    "verifier_warmup",
]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def split_verifier_url(url: object) -> tuple[str, int]:
    """(host, port) of a verifier server's URL, which must be ``http://HOST:PORT`` (nothing
    else: no path, user, query); ValueError saying what is wrong otherwise."""
    if not isinstance(url, str):
        raise ValueError(f"must be a string http://HOST:PORT, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is not a number or out of range
        raise ValueError(f"must be http://HOST:PORT, got {url!r} ({e})") from None
    if (
        parts.scheme != "http"
        or not parts.hostname
        or port is None
        or port == 0
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"must be http://HOST:PORT, got {url!r}")
    return parts.hostname, port


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
    custom: str | None = None  # your reward: "module:function" or a registered name (rewards/custom.py)
    custom_mode: Literal["replace", "add"] = "replace"  # replace the correctness part, or add beside it
    custom_weight: float = 1.0  # the custom part is custom_weight * the function's score
    custom_timeout_s: float = 10.0  # limit per call of the custom function; past it, that part is 0
    math: MathConfig = field(default_factory=MathConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    # Verifier servers (`megatron-rl verifier-server`) that share the scoring with the local pool,
    # each http://HOST:PORT; [] = the local pool only (rewards/remote.py).
    remote: list[str] = field(default_factory=list)
    # The environment variable holding those servers' API key ("" or unset: none is sent).
    remote_api_key_env: str = "MEGATRON_RL_VERIFIER_KEY"
    # What the model thinks between: the format check, the paper's system prompt and the run's
    # tokenizer check follow it. ["[THINK]", "[/THINK]"] for Magistral 1.2 (its tokenizer holds
    # each as one special token); any pair but the default must be one token each.
    think_tags: list[str] = field(default_factory=lambda: list(DEFAULT_THINK_TAGS))

    def __post_init__(self):
        for name in (
            "format_reward",
            "correct_reward",
            "language_reward",
            "length_penalty",
            "task_timeout_s",
            "custom_weight",
        ):
            check_range(name, getattr(self, name), low=0.0)
        check_range("l_max", self.l_max, low=1)
        if not 0 <= self.l_cache <= self.l_max:
            raise ConfigFieldError("l_cache", f"must be in [0, l_max={self.l_max}], got {self.l_cache}")
        # A recipe may be checked on another machine than the one it runs on (a login node):
        # an absolute bound here catches a typo, and the pool checks this machine's cores.
        check_range("workers", self.workers, low=1, high=1024)
        check_choice("custom_mode", self.custom_mode, ("replace", "add"))
        self._check_remote()
        check_think_tags(self.think_tags)
        check_range("custom_timeout_s", self.custom_timeout_s, low=0.0, low_open=True)
        if self.custom is not None:
            resolve(self.custom)  # at load: a bad name, module or function fails here, naming the field
            if self.task_timeout_s and self.task_timeout_s <= self.custom_timeout_s:
                raise ConfigFieldError(
                    "custom_timeout_s",
                    f"must be below task_timeout_s ({self.task_timeout_s:g}), the hard limit of the "
                    f"whole sample, got {self.custom_timeout_s:g}",
                )

    def _check_remote(self) -> None:
        if not isinstance(self.remote, list):
            raise ConfigFieldError("remote", f"must be a list of http://HOST:PORT URLs, got {self.remote!r}")
        seen: dict[tuple[str, int], int] = {}
        for i, url in enumerate(self.remote):
            try:
                where = split_verifier_url(url)
            except ValueError as e:
                raise ConfigFieldError(f"remote[{i}]", str(e)) from None
            if where in seen:
                raise ConfigFieldError(f"remote[{i}]", f"the same server as remote[{seen[where]}] ({url!r})")
            seen[where] = i
        if self.remote_api_key_env and not (
            isinstance(self.remote_api_key_env, str) and _ENV_NAME.fullmatch(self.remote_api_key_env)
        ):
            raise ConfigFieldError(
                "remote_api_key_env",
                f"must be an environment variable name (letters, digits, _) or '', got {self.remote_api_key_env!r}",
            )

    @property
    def replaces_correctness(self) -> bool:
        """Whether a custom reward stands in for the built-in math / code check."""
        return self.custom is not None and self.custom_mode == "replace"


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
    # The whole input record as the data has it (every extra field): what a custom reward is given.
    # None: rebuilt from the fields above (problem_record).
    record: dict[str, Any] | None = None

    def __post_init__(self):
        if self.record is not None and not isinstance(self.record, dict):
            raise ValueError(f"record must be a dict, got {type(self.record).__name__}")
        # A reference (answer / tests) is checked where it is needed, by the built-in check
        # (_correctness): a custom reward that replaces it may need none.
        if self.task not in ("math", "code"):
            raise ValueError(f"task must be 'math' or 'code', got {self.task!r}")


def group_seed(inp: RewardInput) -> int:
    """Seed of the code-test draw: the same for every completion of a group (or of a problem)."""
    key = str(inp.group_id) if inp.group_id is not None else inp.problem
    return zlib.crc32(key.encode())


def _correctness(inp: RewardInput, answer: str, cfg: RewardConfig) -> Verdict:
    # The reference is checked here, where it is needed: a custom reward that replaces this check
    # takes problems without one (data.problems.check_scorable refuses them at load otherwise).
    if inp.task == "math":
        if inp.answer is None:
            raise ValueError("a math sample needs 'answer'")
        return verify_math(answer, inp.answer, cfg.math)
    if not inp.tests:
        raise ValueError("a code sample needs a non-empty 'tests' list")
    block_lang, code = extract_code_block(answer)
    if code is None or not code.strip():
        return Verdict(False, 0.0, "no_answer", "empty code block")
    if inp.language and block_lang != inp.language:
        return Verdict(
            False, 0.0, "wrong_answer", f"code block is {block_lang!r}, the problem asks for {inp.language!r}"
        )
    return verify_code(code, block_lang, inp.tests, cfg.code, seed=group_seed(inp))


def problem_record(inp: RewardInput) -> dict[str, Any]:
    """What a custom reward gets as ``problem``: the input's whole record, or (when the caller did
    not pass one) the fields the reward knows."""
    if inp.record is not None:
        return inp.record
    fields = {"problem": inp.problem, "task": inp.task, "answer": inp.answer, "tests": inp.tests}
    return {k: v for k, v in {**fields, "language": inp.language}.items() if v is not None}


def _custom(inp: RewardInput, cfg: RewardConfig) -> CustomScore:
    if cfg.custom is None:
        raise ValueError("no custom reward is configured")
    return call_custom(
        resolve(cfg.custom), inp.completion, problem_record(inp), timeout_s=cfg.custom_timeout_s
    )


def score(inp: RewardInput, cfg: RewardConfig) -> RewardResult:
    """Score one completion (runs in a verifier worker; see the module docstring)."""
    parsed, why = check_format(inp.completion, inp.task, cfg.think_tags)
    if parsed is None:
        return _zero(cfg, "format_error", why)
    parts: dict[str, float] = {"format": cfg.format_reward}
    info: dict[str, Any] = {}
    custom: CustomScore | None
    if cfg.replaces_correctness:
        custom = _custom(inp, cfg)
        correct, reason, detail = custom.correct, custom.reason, custom.detail
    else:
        verdict = _correctness(inp, parsed.answer, cfg)
        share = verdict.fraction if cfg.code.partial_credit and inp.task == "code" else float(verdict.correct)
        parts["correct"] = cfg.correct_reward * share
        correct, reason, detail = verdict.correct, verdict.reason, verdict.detail
        custom = _custom(inp, cfg) if cfg.custom is not None else None
        if custom is not None and custom.failed:  # the correctness check stands; the failure shows
            reason, detail = custom.reason, f"{custom.detail} (correctness: {verdict.reason})"
    if custom is not None:
        parts["custom"] = cfg.custom_weight * custom.score
        info["custom"] = {"score": custom.score, "reason": custom.reason, "detail": custom.detail}
    consistent, langs = language_consistent(inp.problem, parsed.thinking, parsed.answer)
    parts["length"] = (
        length_penalty(inp.num_tokens, cfg.l_max, cfg.l_cache, cfg.length_penalty)
        if inp.num_tokens is not None
        else 0.0
    )
    parts["language"] = cfg.language_reward if consistent else 0.0
    return RewardResult(
        sum(parts.values()),
        parts,
        reason,
        detail,
        correct=correct,
        format_ok=True,
        info={"languages": langs, **info},
    )


def hard_timeout_s(inp: RewardInput, cfg: RewardConfig) -> float:
    """Wall-clock limit after which the pool kills the worker scoring ``inp``: the limits of what
    runs (the correctness check, the custom function's soft limit) plus 10 s of slack."""
    if cfg.task_timeout_s:
        return cfg.task_timeout_s
    custom = cfg.custom_timeout_s if cfg.custom is not None else 0.0
    if cfg.replaces_correctness:
        return custom + 10.0
    if inp.task == "math":  # two parses and one compare, each bounded by SIGALRM, plus slack
        return 2 * cfg.math.parse_timeout_s + cfg.math.verify_timeout_s + custom + 10.0
    n = min(len(inp.tests or ()), cfg.code.tests_per_problem)
    return cfg.code.compile_timeout_s + n * (math.ceil(cfg.code.test_timeout_s) + 2) + custom + 10.0


def prepare_verifiers(inputs: list[RewardInput], cfg: RewardConfig) -> None:
    """One-off work before scoring: build the precompiled C++ header (~5 s, once per compiler and
    flag set) in the caller, so it is not charged to the first C++ sample's hard time limit."""
    if not cfg.replaces_correctness and any(i.task == "code" and i.language == "cpp" for i in inputs):
        ensure_pch(cfg.code)


def verifier_warmup(cfg: RewardConfig) -> Callable[[], object] | None:
    """What a :class:`VerifierPool` for ``cfg`` runs in each worker before its first task
    (``warmup=``): the custom reward's import, so it is not charged to a sample's limit."""
    return partial(warm_up, cfg.custom) if cfg.custom is not None else None


def _zero(cfg: RewardConfig, reason: str, detail: str) -> RewardResult:
    names = ["format", "custom"] if cfg.replaces_correctness else ["format", "correct"]
    if cfg.custom is not None and cfg.custom_mode == "add":
        names.append("custom")
    return RewardResult(0.0, dict.fromkeys([*names, "length", "language"], 0.0), reason, detail)


def failed_result(reason: str, detail: str, cfg: RewardConfig) -> RewardResult:
    """The result of a sample whose worker was killed or died (:class:`PoolTaskError`): 0, every
    part 0. When a custom reward replaces the correctness check it is the one thing that runs long
    or can crash there, so the detail says so."""
    return _zero(cfg, reason, f"custom: {detail}" if cfg.replaces_correctness else detail)


def score_many(
    inputs: list[RewardInput], cfg: RewardConfig, pool: VerifierPool | None = None
) -> list[RewardResult]:
    """Score a batch in the pool (one is started and stopped when not given); input order."""
    prepare_verifiers(inputs, cfg)
    own = pool is None
    pool = pool or VerifierPool(cfg.workers, warmup=verifier_warmup(cfg))
    try:
        futures = [pool.submit(score, inp, cfg, timeout_s=hard_timeout_s(inp, cfg)) for inp in inputs]
        deadline = pool.deadline()  # every sample scored by then: each within its hard limit
        out = []
        for f in futures:
            try:
                out.append(pool.result(f, deadline))
            except PoolTaskError as e:
                out.append(failed_result(e.reason, e.detail, cfg))
        return out
    finally:
        if own:
            pool.close()
