"""``megatron-rl curate``: data curation tools, each reading a problem file and writing the kept
records (JSONL, atomically) plus ``OUT.report.json`` -- what was kept and dropped, and why, also
printed at the end.

    megatron-rl curate math-format  --input raw.jsonl --output formatted.jsonl
    megatron-rl curate difficulty   --input formatted.jsonl --output kept.jsonl --model ckpt-hf/ --k 16
    megatron-rl curate difficulty   --input formatted.jsonl --output kept.jsonl --scored scored.jsonl
    megatron-rl curate code-tests   --input code.jsonl --output code-curated.jsonl [--min-tests 3]
    megatron-rl curate translate-mark --input kept.jsonl --output marked.jsonl --languages fr,de,zh
    megatron-rl curate translate    --input marked.jsonl --output translated.jsonl \
                                    --servers URL --tokenizer DIR
    megatron-rl curate sft-traces   --run runs/medium --output sft.jsonl --min-step 200 \\
                                    --general chat.jsonl --tokenizer ckpt-hf/
    python -m megatron_rl.cli.curate ...   (the same)

``difficulty`` also writes ``OUT.difficulty.jsonl`` (the verdict on every problem),
``OUT.flagged.jsonl`` (problems whose majority answer contradicts the reference) and
``OUT.pass_rate.png``; the two-stage recipe is in :mod:`megatron_rl.data.difficulty`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_rl.data.problems import read_problems, write_problems
from megatron_rl.data.report import CurationReport
from megatron_rl.errors import ArgumentParser, InputError, float_arg, int_arg, run_cli, value_errors_as_usage
from megatron_rl.fileio import atomic_write_json, check_output_apart, write_jsonl

__all__ = ["build_parser", "main"]


def _sidecar(output: str, suffix: str) -> Path:
    out = Path(output)
    return out.with_name(out.name[: -len(out.suffix)] + suffix if out.suffix else out.name + suffix)


def _finish(report: CurationReport, args, records) -> int:
    n = write_problems(args.output, records)
    atomic_write_json(_sidecar(args.output, ".report.json"), report.to_json())
    report.print()
    print(f"wrote {n} records to {args.output}", file=sys.stderr)
    return 0


def _math_format(args) -> int:
    from megatron_rl.data.math_format import (  # lazy: each verb imports only what it runs, so --help stays quick
        MathFormatConfig,
        format_filter,
    )

    cfg = MathFormatConfig(convert_multiple_choice=not args.no_convert, workers=args.workers)
    kept, report = format_filter(read_problems(args.input), cfg, progress=not args.quiet)
    return _finish(report, args, kept)


def _difficulty(args) -> int:
    from megatron_rl.data.difficulty import (  # lazy: each verb imports only what it runs, so --help stays quick
        DifficultyConfig,
        attempts_from_scored,
        difficulty_filter,
    )
    from megatron_rl.evaluation.plots import (
        pass_rate_histogram,  # lazy: each verb imports only what it runs, so --help stays quick
    )
    from megatron_rl.rewards.pool import (
        VerifierPool,  # lazy: each verb imports only what it runs, so --help stays quick
    )

    cfg = DifficultyConfig(
        low=args.low,
        high=args.high,
        majority=args.majority,
        drop_flagged=not args.keep_flagged,
        workers=args.workers,
    )
    problems = read_problems(args.input, limit=args.limit)
    with VerifierPool(cfg.workers) as pool:
        if args.scored:
            from megatron_rl.cli.reward import (
                reward_config,  # lazy: each verb imports only what it runs, so --help stays quick
            )

            tags = reward_config(args.recipe, args.overrides, args.workers).think_tags
            attempts = attempts_from_scored(args.scored, tags)
        else:
            attempts = _sample(args, problems, pool)
        kept, details, report = difficulty_filter(problems, attempts, cfg, pool=pool, progress=not args.quiet)
    write_jsonl(_sidecar(args.output, ".difficulty.jsonl"), (d.to_json() for d in details))
    by_id = {p.id: p for p in problems}
    write_jsonl(
        _sidecar(args.output, ".flagged.jsonl"),
        (
            {
                **by_id[d.problem_id].to_json(),
                "pass_rate": d.pass_rate,
                "majority_answer": d.majority_answer,
                "majority_count": d.majority_count,
                "samples": d.samples,
            }
            for d in details
            if d.flagged
        ),
    )
    counts = {d.samples for d in details}
    pass_rate_histogram(
        [d.pass_rate for d in details if d.samples],
        _sidecar(args.output, ".pass_rate.png"),
        low=cfg.low,
        high=cfg.high,
        samples=counts.pop() if len(counts) == 1 else None,
    )
    return _finish(report, args, kept)


def _servers(args) -> list[str] | None:
    return args.servers.split(",") if args.servers else None


def _sample(args, problems, pool):
    from megatron_rl.cli.reward import (  # lazy: each verb imports only what it runs, so --help stays quick
        env_config,
        reward_config,
    )
    from megatron_rl.data.sampling import (  # lazy: each verb imports only what it runs, so --help stays quick
        SamplingConfig,
        check_think_tags_in,
        close_generator,
        load_tokenizer,
        open_generator,
        render_prompt,
        sample_and_score,
        sequence_budget,
    )
    from megatron_rl.rewards.template import (
        resolve_system_prompt,  # lazy: each verb imports only what it runs, so --help stays quick
    )

    reward_cfg = reward_config(args.recipe, args.overrides, args.workers)
    if args.tokenizer is None and args.model is None:
        raise ValueError("--servers needs --tokenizer (the served model's tokenizer folder)")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    check_think_tags_in(tokenizer, reward_cfg.think_tags, name=args.tokenizer or args.model)
    cfg = SamplingConfig(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        system_prompt=resolve_system_prompt(args.system_prompt, reward_cfg.think_tags),
        env=env_config(args.recipe, args.overrides),  # curated through the run's environment
    )
    longest = max(
        (len(render_prompt(tokenizer, p.problem, p.task, system_prompt=cfg.system_prompt)) for p in problems),
        default=1,
    )
    generator = open_generator(
        model=args.model,
        servers=_servers(args),
        max_len=sequence_budget(cfg, longest),
        max_slots=args.max_slots,
    )
    try:
        return sample_and_score(
            problems, generator, tokenizer, cfg, reward_cfg, pool=pool, progress=not args.quiet
        )
    finally:
        close_generator(generator)


def _code_tests(args) -> int:
    from megatron_rl.data.code_tests import (  # lazy: each verb imports only what it runs, so --help stays quick
        CodeCurationConfig,
        curate_code_problems,
    )
    from megatron_rl.rewards.code import (
        CodeConfig,  # lazy: each verb imports only what it runs, so --help stays quick
    )

    cfg = CodeCurationConfig(
        min_tests=args.min_tests,
        min_agree_to_repair=args.min_agree,
        max_solutions=args.max_solutions,
        workers=args.workers,
        languages=args.languages,
        code=CodeConfig(test_timeout_s=args.test_timeout),
    )
    kept, report = curate_code_problems(read_problems(args.input), cfg, progress=not args.quiet)
    return _finish(report, args, kept)


def _translate_mark(args) -> int:
    from megatron_rl.data.translate import (
        mark_for_translation,  # lazy: each verb imports only what it runs, so --help stays quick
    )

    out, report = mark_for_translation(
        read_problems(args.input), fraction=args.fraction, languages=args.languages, seed=args.seed
    )
    return _finish(report, args, out)


def _translate(args) -> int:
    from megatron_rl.data.sampling import (  # lazy: each verb imports only what it runs, so --help stays quick
        close_generator,
        load_tokenizer,
        open_generator,
    )
    from megatron_rl.data.translate import (  # lazy: each verb imports only what it runs, so --help stays quick
        GeneratorTranslator,
        load_translator,
        translate_marked,
    )

    problems = read_problems(args.input)
    generator = None
    if args.translator:
        translator = load_translator(args.translator)
    else:
        if args.tokenizer is None and args.model is None:
            raise ValueError("--servers needs --tokenizer (the served model's tokenizer folder)")
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        generator = open_generator(
            model=args.model, servers=_servers(args), max_len=args.max_len, max_slots=args.max_slots
        )
        translator = GeneratorTranslator(generator, tokenizer, max_new_tokens=args.max_new_tokens)
    try:
        out, report = translate_marked(problems, translator, progress=not args.quiet)
    finally:
        close_generator(generator)
    return _finish(report, args, out)


def _sft_traces(args) -> int:
    from megatron_rl.data.rundir import (
        read_samples,  # lazy: each verb imports only what it runs, so --help stays quick
    )
    from megatron_rl.data.sft import (  # lazy: each verb imports only what it runs, so --help stays quick
        SFTTraceConfig,
        collect_traces,
        load_general,
        mix_general,
    )

    cfg = SFTTraceConfig(
        min_step=args.min_step,
        max_per_problem=args.max_per_problem,
        upsample_below=args.upsample_below,
        max_upsample=args.max_upsample,
        general_share=args.general_share if args.general else 0.0,
        seed=args.seed,
    )
    traces, report = collect_traces(read_samples(args.run), cfg, progress=not args.quiet)
    general = []
    if args.general:
        if not args.tokenizer:
            raise ValueError("--general needs --tokenizer (to render the chats with its template)")
        from megatron_rl.data.sampling import (
            load_tokenizer,  # lazy: each verb imports only what it runs, so --help stays quick
        )

        general = load_general(args.general, load_tokenizer(args.tokenizer))
    return _finish(report, args, mix_general(traces, general, cfg, report))


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="tokenizer folder (default: the --model folder)")
    p.add_argument(
        "--max-slots", type=int_arg(1, 1 << 16), default=16, help="--model only: sequences decoded together"
    )
    p.add_argument("--k", type=int_arg(1, 1 << 16), default=16, help="samples per problem (default 16)")
    p.add_argument("--max-new-tokens", type=int_arg(1, 1 << 24), default=4096)
    p.add_argument("--temperature", type=float_arg(0.0, 100.0), default=1.0)
    p.add_argument("--top-p", type=float_arg(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    p.add_argument(
        "--system-prompt",
        default="paper",
        help='as data.system_prompt: "paper" (Magistral\'s, the default), "none", or the text '
        "(with {think_open} {think_close} for reward.think_tags): filter with the run's prompt",
    )
    p.add_argument("--recipe", help="YAML recipe whose reward section is used")
    p.add_argument("overrides", nargs="*", help="reward.KEY=VALUE overrides")


def _common(p: argparse.ArgumentParser, *, needs_input: bool = True) -> None:
    if needs_input:
        p.add_argument("--input", required=True, help="problem file (JSONL, CSV, Parquet, hf:NAME)")
    p.add_argument("--output", required=True, help="JSONL to write (atomically)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_math_format(sub) -> None:
    m = sub.add_parser(
        "math-format", help="drop proofs, multi-part problems, unverifiable answers; convert multiple choice"
    )
    _common(m)
    m.add_argument("--no-convert", action="store_true", help="drop multiple-choice problems instead")
    m.add_argument("--workers", type=int_arg(1, 4096), default=2, help="verifier processes")
    m.set_defaults(func=_guarded(_math_format))


def _add_difficulty(sub) -> None:
    d = sub.add_parser("difficulty", help="keep problems with a pass rate strictly inside (low, high)")
    _common(d)
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model folder, run in this process")
    src.add_argument("--servers", help="comma-separated generation server URLs")
    src.add_argument(
        "--scored",
        help="pre-scored completions (JSONL with problem_id/group_id, "
        "completion, correct or reason) instead of sampling",
    )
    _add_sampling(d)
    d.add_argument("--low", type=float_arg(0.0, 1.0), default=0.0, help="keep pass rate > LOW (default 0)")
    d.add_argument("--high", type=float_arg(0.0, 1.0), default=1.0, help="keep pass rate < HIGH (default 1)")
    d.add_argument(
        "--majority",
        type=float_arg(0.0, 1.0),
        default=0.5,
        help="flag when more than this share agrees on a wrong answer (default 0.5)",
    )
    d.add_argument("--keep-flagged", action="store_true", help="do not drop flagged problems")
    d.add_argument("--limit", type=int_arg(1), help="only the first N problems")
    d.add_argument("--workers", type=int_arg(1, 4096), default=2, help="verifier processes")
    d.set_defaults(func=_guarded(_difficulty))


# fastText's lid.176 labels (the language reward's detector): ISO 639 codes of 2 or 3 letters.
_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}")
_PROGRAM_LANGUAGE = re.compile(r"[a-z][a-z0-9+#]*")


def _names(pattern: re.Pattern[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list, each item matching ``pattern`` (no empty
    item: ``fr,,de`` is a typo, not a language named "")."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        for i, item in enumerate(items):
            if not pattern.fullmatch(item):
                shown = repr(item) if item else "empty"
                raise argparse.ArgumentTypeError(f"item {i + 1} of {text!r} is {shown}: expected {what}")
        return items

    return parse


def _add_code_tests(sub) -> None:
    c = sub.add_parser("code-tests", help="keep tests the solutions agree on; repair wrong outputs")
    _common(c)
    c.add_argument(
        "--min-tests", type=int_arg(0), default=3, help="fewer tests: drop the problem (default 3)"
    )
    c.add_argument(
        "--min-agree",
        type=int_arg(1),
        default=2,
        help="solutions that must agree to replace an expected output (default 2)",
    )
    c.add_argument("--max-solutions", type=int_arg(1), default=8, help="solutions run per problem")
    c.add_argument(
        "--languages",
        default=["python", "cpp"],
        type=_names(_PROGRAM_LANGUAGE, "a programming language name (python, cpp)"),
        help="statement copies for problems with no language (default python,cpp)",
    )
    c.add_argument(
        "--test-timeout",
        type=float_arg(0.0, 86400.0, low_open=True),
        default=4.0,
        help="seconds per test (default 4)",
    )
    c.add_argument("--workers", type=int_arg(1, 4096), default=2, help="sandbox processes")
    c.set_defaults(func=_guarded(_code_tests))


def _add_translation(sub) -> None:
    tm = sub.add_parser("translate-mark", help="mark a share of problems for translation")
    _common(tm)
    tm.add_argument("--fraction", type=float_arg(0.0, 1.0), default=0.1, help="share marked (default 0.1)")
    tm.add_argument(
        "--languages",
        required=True,
        type=_names(_LANGUAGE_CODE, "a language code as the language reward names it (en, fr, zh)"),
        help="comma-separated target languages, e.g. fr,de",
    )
    tm.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    tm.set_defaults(func=_guarded(_translate_mark))
    t = sub.add_parser("translate", help="translate the marked problems (adds copies)")
    _common(t)
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--translator", help="MODULE:FUNCTION, a callable (texts, language) -> texts")
    src.add_argument("--model", help="Hugging Face model folder, run in this process")
    src.add_argument("--servers", help="comma-separated generation server URLs")
    t.add_argument("--tokenizer", help="tokenizer folder (default: the --model folder)")
    t.add_argument("--max-new-tokens", type=int_arg(1, 1 << 24), default=2048)
    t.add_argument(
        "--max-len", type=int_arg(2, 1 << 24), default=8192, help="--model only: tokens per sequence"
    )
    t.add_argument(
        "--max-slots", type=int_arg(1, 1 << 16), default=16, help="--model only: sequences decoded together"
    )
    t.set_defaults(func=_guarded(_translate))


def _add_sft_traces(sub) -> None:
    s = sub.add_parser("sft-traces", help="SFT data from a run's correct completions")
    _common(s, needs_input=False)
    s.add_argument("--run", required=True, help="run directory (holding samples.jsonl) or the file")
    s.add_argument("--min-step", type=int_arg(0), default=0, help="skip samples of earlier steps")
    s.add_argument("--max-per-problem", type=int_arg(1), default=4, help="distinct traces per problem")
    s.add_argument(
        "--upsample-below",
        type=float_arg(0.0, 1.0),
        default=0.5,
        help="repeat traces of problems with a lower pass rate (default 0.5)",
    )
    s.add_argument("--max-upsample", type=int_arg(1), default=4, help="most copies of a trace (default 4)")
    s.add_argument("--general", help="general instruction data (JSONL of messages, or prompt/response)")
    s.add_argument(
        "--general-share",
        type=float_arg(0.0, 1.0, note=" (below 1: some traces stay)"),
        default=0.1,
        help="share of general examples in the output (default 0.1)",
    )
    s.add_argument("--tokenizer", help="tokenizer folder (renders --general)")
    s.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0)
    s.set_defaults(func=_guarded(_sft_traces))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``curate`` parser (or its subcommands added to ``parser``); ``args.func(args)`` runs
    the chosen tool and returns the exit status."""
    p = parser or ArgumentParser(prog="megatron-rl curate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="tool", required=True, metavar="TOOL")
    for add in (_add_math_format, _add_difficulty, _add_code_tests, _add_translation, _add_sft_traces):
        add(sub)
    return p


# The files each tool writes beside --output (see the module docstring).
_SIDECARS = (".report.json", ".difficulty.jsonl", ".flagged.jsonl", ".pass_rate.png")
# Every argument of any tool that names something read.
_INPUT_ARGS = ("input", "scored", "run", "general", "recipe", "tokenizer", "model")


def _check_paths(args: argparse.Namespace) -> None:
    """Before any work: every file the tool will write (``--output`` and its sidecars) is apart
    from every file or folder it reads (OutputError naming both)."""
    inputs = [getattr(args, a, None) for a in _INPUT_ARGS]
    inputs = [i for i in inputs if i and not str(i).startswith("hf:")]
    given = getattr(args, "input", None)
    if given and not str(given).startswith("hf:") and not Path(given).exists():
        raise InputError(f"--input {given}: no such file or folder")
    for written in (Path(args.output), *(_sidecar(args.output, s) for s in _SIDECARS)):
        check_output_apart(written, inputs, what="--output" if str(written) == args.output else "output")


def _guarded(tool):
    """The tool, behind the path check; a ValueError from the tool's own option checks (a
    ConfigFieldError of its config, say) is a usage error, one line with exit status 2."""

    def run(args: argparse.Namespace) -> int:
        _check_paths(args)
        with value_errors_as_usage():
            return tool(args)

    return run


def main(argv: list[str] | None = None) -> int:
    """``argv`` without the leading ``curate``: e.g. ``["math-format", "--input", ...]``."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl curate", main))
