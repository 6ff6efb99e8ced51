"""``megatron-rl reward``: score a JSONL file of completions with the full reward.

    megatron-rl reward --input IN.jsonl --output OUT.jsonl [--workers 2] [--skip-bad]
                       [--recipe RECIPE.yaml] [--tokenizer HF_DIR] [reward.l_max=16384 ...]
    python -m megatron_rl.rewards ...   (the same)

Each input line is a JSON object with ``problem`` and ``completion`` and either ``answer`` (math)
or ``tests`` + ``language`` (code; ``tests`` is a list of ``{"input": stdin, "output": stdout}``
or HumanEval-style ``{"type": "function", "test": "...def check(candidate)...", "entry_point":
"name"}``; ``language`` is ``python`` or ``cpp``). Optional: ``task`` (``math``/``code``, else
inferred), ``group_id`` (completions of a group draw the same code tests) and ``num_tokens`` (for
the length penalty; without it none is applied unless ``--tokenizer`` is given). Every output line
is the input object plus ``reward``, ``parts``, ``reason`` and ``detail``, in input order. The
output file is written atomically. A malformed line is an error naming its line number, or with
``--skip-bad`` is written with reason ``bad_input``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, deque
from pathlib import Path

from megatron_rl.rewards.code import ensure_pch
from megatron_rl.rewards.compose import RewardConfig, RewardInput, hard_timeout_s, score
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool

__all__ = ["main", "parse_line"]


class BadLine(ValueError):
    pass


def _check_tests(tests) -> None:
    if not isinstance(tests, list) or not tests:
        raise BadLine("'tests' must be a non-empty list")
    for k, t in enumerate(tests):
        if not isinstance(t, dict):
            raise BadLine(f"tests[{k}] must be an object")
        if t.get("type") == "function":
            if not isinstance(t.get("test"), str) or not isinstance(t.get("entry_point"), str):
                raise BadLine(f"tests[{k}]: a function test needs string 'test' and 'entry_point'")
        elif not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise BadLine(f"tests[{k}] needs string 'input' and 'output'")


def parse_line(obj) -> RewardInput:
    """Validate one decoded JSON line; raises BadLine naming the field."""
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("problem", "completion"):
        if not isinstance(obj.get(key), str):
            raise BadLine(f"missing or non-string '{key}'")
    task = obj.get("task") or ("code" if "tests" in obj else "math" if "answer" in obj else None)
    if task == "math":
        if obj.get("answer") is None:
            raise BadLine("a math line needs 'answer'")
    elif task == "code":
        _check_tests(obj.get("tests"))
        if obj.get("language") not in ("python", "cpp"):
            raise BadLine(f"'language' must be 'python' or 'cpp', got {obj.get('language')!r}")
    else:
        raise BadLine("needs 'answer' (math) or 'tests' + 'language' (code), or a valid 'task'")
    n = obj.get("num_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise BadLine(f"'num_tokens' must be a non-negative integer, got {n!r}")
    return RewardInput(problem=obj["problem"], completion=obj["completion"], task=task,
                       answer=None if obj.get("answer") is None else str(obj["answer"]),
                       tests=obj.get("tests"), language=obj.get("language"),
                       group_id=obj.get("group_id"), num_tokens=n)


def _read(path: Path, skip_bad: bool, tokenizer):
    """Yield ``(line_number, record, RewardInput | error message)``."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                inp = parse_line(obj)
            except (json.JSONDecodeError, BadLine, ValueError) as e:
                msg = f"{path}:{lineno}: {e}"
                if not skip_bad:
                    raise SystemExit(f"megatron-rl reward: {msg} (use --skip-bad to score it 'bad_input')")
                yield lineno, obj if isinstance(obj, dict) else {"raw": line.rstrip("\n")}, msg
                continue
            if inp.num_tokens is None and tokenizer is not None:
                inp.num_tokens = len(tokenizer(inp.completion, add_special_tokens=False)["input_ids"])
            yield lineno, obj, inp


def _load_config(args) -> RewardConfig:
    from megatron_rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.recipe, args.overrides).reward
    except ConfigError as e:
        raise SystemExit(f"megatron-rl reward: {e}") from None
    if args.workers:
        cfg.workers = args.workers
    return cfg


def run(args) -> Counter:
    cfg = _load_config(args)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    out_path = Path(args.output)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    reasons: Counter = Counter()
    total = 0.0
    window: deque = deque()
    pch_ready = False
    from tqdm import tqdm

    bar = tqdm(desc="scoring", unit="sample", file=sys.stderr, disable=args.quiet)

    def flush(until_size: int, out) -> None:
        nonlocal total
        while len(window) > until_size:
            obj, pending = window.popleft()
            if isinstance(pending, str):
                res = {"reward": 0.0, "parts": {}, "reason": "bad_input", "detail": pending}
            else:
                try:
                    res = pending.result().to_json()
                except PoolTaskError as e:
                    res = {"reward": 0.0, "parts": {}, "reason": e.reason, "detail": e.detail}
            reasons[res["reason"]] += 1
            total += res["reward"]
            out.write(json.dumps({**obj, **res}, ensure_ascii=False) + "\n")
            bar.update(1)

    try:
        with VerifierPool(cfg.workers) as pool, tmp.open("w", encoding="utf-8") as out:
            for _, obj, inp in _read(Path(args.input), args.skip_bad, tokenizer):
                if isinstance(inp, str):
                    window.append((obj, inp))
                else:
                    if inp.language == "cpp" and not pch_ready:
                        ensure_pch(cfg.code)  # once, outside the per-sample hard limits
                        pch_ready = True
                    window.append((obj, pool.submit(score, inp, cfg, timeout_s=hard_timeout_s(inp, cfg))))
                flush(8 * cfg.workers, out)  # keep a bounded number of samples in flight
            flush(0, out)
        os.replace(tmp, out_path)
    finally:
        bar.close()
        if tmp.exists():
            tmp.unlink()
    n = sum(reasons.values())
    print(f"scored {n} samples -> {out_path}; mean reward {total / max(n, 1):.4f}; reasons: "
          + ", ".join(f"{k} {v}" for k, v in reasons.most_common()), file=sys.stderr)
    return reasons


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="megatron-rl reward", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL of samples")
    p.add_argument("--output", required=True, help="JSONL to write (atomically)")
    p.add_argument("--workers", type=int, default=0, help="verifier processes (default: reward.workers)")
    p.add_argument("--skip-bad", action="store_true", help="score malformed lines 'bad_input' instead of failing")
    p.add_argument("--recipe", help="YAML recipe; its 'reward' section is used")
    p.add_argument("--tokenizer", help="local Hugging Face tokenizer folder, to count tokens for the length penalty")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.l_max=16384")
    p.set_defaults(func=lambda a: (run(a), 0)[1])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
