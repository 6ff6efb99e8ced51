"""``megatron-rl reward``: score a JSONL file of completions with the full reward.

    megatron-rl reward --input IN.jsonl --output OUT.jsonl [--workers 2] [--skip-bad]
                       [--recipe RECIPE.yaml] [--tokenizer HF_DIR] [reward.l_max=16384 ...]

Each input line is a JSON object with ``problem`` and ``completion`` and either ``answer`` (math)
or ``tests`` + ``language`` (code; ``tests`` is a list of ``{"input": stdin, "output": stdout}``
or HumanEval-style ``{"type": "function", "test": "...def check(candidate)...", "entry_point":
"name"}``; ``language`` is ``python`` or ``cpp``). Optional: ``task`` (``math``/``code``, else
inferred), ``group_id`` (completions of a group draw the same code tests) and ``num_tokens`` (for
the length penalty; without it none is applied unless ``--tokenizer`` is given). Every output line
is the input object plus ``reward``, ``parts``, ``reason`` and ``detail``, in input order. The
output file is written atomically. A malformed line is an error naming its file, line and field
(exit status 1, nothing written), or with ``--skip-bad`` is reported on stderr the same way and
left out: the output holds exactly the good records. A bad recipe or override (``reward.custom``
that does not resolve included) is one line naming the field, exit status 2.

Your own reward: ``reward.custom=module:function`` (or a name registered in the
``megatron_rl.rewards`` entry-point group) calls ``function(completion, problem)`` for every
well-formed completion, ``problem`` being the whole input line; ``reward.custom_mode=add`` keeps
the built-in correctness check beside it. See ``megatron_rl/rewards/custom.py``.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from megatron_rl.data.problems import DataError, check_scorable, problem_from_json, reward_input
from megatron_rl.errors import ArgumentParser, InputError, OutputError, ResourceError, UsageError, int_arg
from megatron_rl.fileio import JsonlError, atomic_path, check_output_apart, iter_jsonl
from megatron_rl.rewards.code import ensure_pch
from megatron_rl.rewards.compose import (
    RewardConfig,
    RewardInput,
    failed_result,
    hard_timeout_s,
    score,
    verifier_warmup,
)
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool, max_workers

if TYPE_CHECKING:
    from megatron_rl.environments.config import EnvConfig
    from megatron_rl.fileio import JsonValue

__all__ = ["env_config", "main", "parse_line", "reward_config"]


def parse_line(obj: JsonValue, where: str, *, needs_reference: bool = True) -> RewardInput:
    """Validate one decoded line (``where`` is ``file:line``); raises :class:`DataError` naming
    the place and the field. ``needs_reference`` False: a custom reward replaces the built-in
    check, so the line needs no reference answer or tests."""
    problem = problem_from_json(obj, where)
    if not isinstance(obj.get("completion"), str):
        raise DataError(f"{where}: completion: missing or not a string")
    if problem.task == "code" and obj.get("language") not in ("python", "cpp"):
        raise DataError(f"{where}: language: must be 'python' or 'cpp', got {obj.get('language')!r}")
    check_scorable(problem, where, needs_reference=needs_reference)
    n = obj.get("num_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise DataError(f"{where}: num_tokens: must be a non-negative integer, got {n!r}")
    group = obj.get("group_id")
    inp = reward_input(
        problem, obj["completion"], num_tokens=n, group_id=None if group is None else str(group)
    )
    inp.record = obj  # a custom reward is given the whole line, every extra field included
    return inp


def _read(path: Path, skip_bad: bool, tokenizer, bad: list[str], needs_reference: bool = True):
    """Yield ``(record, RewardInput)`` for every good line; a bad line stops the run, or with
    ``skip_bad`` is reported in ``bad`` (``file:line: why``) and left out."""
    try:
        lines = iter_jsonl(path, skip_bad=skip_bad)
        for lineno, obj in lines:
            try:
                if isinstance(obj, JsonlError):
                    raise DataError(str(obj))
                inp = parse_line(obj, f"{path}:{lineno}", needs_reference=needs_reference)
            except DataError as e:
                if not skip_bad:
                    raise
                bad.append(str(e))
                continue
            if inp.num_tokens is None and tokenizer is not None:
                inp.num_tokens = len(tokenizer(inp.completion, add_special_tokens=False)["input_ids"])
            yield obj, inp
    except DataError as e:  # JsonlError is one: both name the file and line
        raise InputError(f"{e}{'' if skip_bad else ' (--skip-bad leaves bad lines out)'}") from None


def reward_config(recipe: str | None, overrides: list[str], workers: int | None) -> RewardConfig:
    """The reward settings of ``reward``, ``eval`` and ``curate``: a recipe's ``reward`` section
    with ``reward.KEY=VALUE`` overrides (ValueError naming the file, line and field)."""
    from megatron_rl.orchestration.recipe import (
        load_config,  # lazy: the recipe imports torch; the parser must not
    )

    bad = [o for o in overrides if not o.startswith(("reward.", "env."))]
    if bad:
        raise UsageError(f"only reward.KEY=VALUE and env.KEY=VALUE overrides apply here, got {' '.join(bad)}")
    if workers is not None and not 1 <= workers <= max_workers():
        raise UsageError(f"--workers: must be in [1, {max_workers()}] on this machine, got {workers}")
    cfg = load_config(recipe, overrides).reward  # ConfigError names the file, line and field
    if workers is not None:
        cfg.workers = workers
    return cfg


def env_config(recipe: str | None, overrides: list[str]) -> EnvConfig | None:
    """The multi-turn environment of ``eval`` and ``curate``: a recipe's ``env`` section with
    ``env.KEY=VALUE`` overrides; None when it names none (single-turn sampling)."""
    from megatron_rl.orchestration.recipe import (
        load_config,  # lazy: the recipe imports torch; the parser must not
    )

    env = load_config(recipe, [o for o in overrides if o.startswith("env.")]).env
    return env if env.enabled else None


def run(args) -> Counter:
    """Score ``args.input`` into ``args.output``; every argument is checked before the verifier
    pool starts, and the output is refused before its first byte if it would touch the input."""
    cfg = reward_config(args.recipe, args.overrides, args.workers)
    in_path, out_path = Path(args.input), Path(args.output)
    if not in_path.is_file():
        raise InputError(f"--input {in_path}: no such file")
    check_output_apart(out_path, [in_path, args.recipe, args.tokenizer], what="--output")
    from megatron_rl.data.sampling import load_tokenizer  # lazy: it imports torch; the parser must not

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    # Every line is checked before the verifier pool starts (a parse pass costs little next to
    # scoring): a bad line stops the command before any work, or with --skip-bad is listed.
    bad: list[str] = []
    good = sum(1 for _ in _read(in_path, args.skip_bad, None, bad, not cfg.replaces_correctness))
    if not good:
        raise InputError(
            f"--input {in_path}: no records to score"
            + (f" ({len(bad)} bad lines left out)" if bad else " (the file is empty)")
        )
    reasons: Counter = Counter()
    total = 0.0
    window: deque = deque()
    pch_ready = False
    bar = tqdm(total=good, desc="scoring", unit="sample", file=sys.stderr, disable=args.quiet)

    def flush(until_size: int, out, pool: VerifierPool) -> None:
        nonlocal total
        while len(window) > until_size:
            obj, pending = window.popleft()
            try:  # due by the pool's bound: each task queued before it within its hard limit
                res = pool.result(pending).to_json()
            except PoolTaskError as e:
                res = failed_result(e.reason, e.detail, cfg).to_json()
            reasons[res["reason"]] += 1
            total += res["reward"]
            out.write(json.dumps({**obj, **res}, ensure_ascii=False) + "\n")
            bar.update(1)

    try:
        with (
            VerifierPool(cfg.workers, warmup=verifier_warmup(cfg)) as pool,
            atomic_path(out_path) as tmp,
            tmp.open("w", encoding="utf-8") as out,
        ):
            for obj, inp in _read(in_path, args.skip_bad, tokenizer, [], not cfg.replaces_correctness):
                if inp.language == "cpp" and not pch_ready and not cfg.replaces_correctness:
                    ensure_pch(cfg.code)  # once, outside the per-sample hard limits
                    pch_ready = True
                window.append((obj, pool.submit(score, inp, cfg, timeout_s=hard_timeout_s(inp, cfg))))
                flush(8 * cfg.workers, out, pool)  # keep a bounded number of samples in flight
            flush(0, out, pool)
    except OSError as e:  # the output's folder cannot be made or written (inputs were read above)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceError(f"cannot write {out_path}: disk full ({e.strerror})") from None
        raise OutputError(f"cannot write {out_path}: {e.strerror}") from None
    finally:
        bar.close()
    for line in bad:
        print(f"megatron-rl reward: skipped {line}", file=sys.stderr)
    n = sum(reasons.values())
    print(
        f"scored {n} samples -> {out_path}; mean reward {total / max(n, 1):.4f}; reasons: "
        + ", ".join(f"{k} {v}" for k, v in reasons.most_common())
        + (f"; {len(bad)} bad lines skipped" if bad else ""),
        file=sys.stderr,
    )
    return reasons


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or ArgumentParser(prog="megatron-rl reward", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL of samples")
    p.add_argument("--output", required=True, help="JSONL to write (atomically)")
    p.add_argument(
        "--workers", type=int_arg(1, 4096), default=None, help="verifier processes (default: reward.workers)"
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="report malformed lines (file:line: why) and leave them out instead of failing",
    )
    p.add_argument("--recipe", help="YAML recipe; its 'reward' section is used")
    p.add_argument(
        "--tokenizer", help="local Hugging Face tokenizer folder, to count tokens for the length penalty"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.l_max=16384")
    p.set_defaults(func=lambda a: (run(a), 0)[1])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
