"""Code-test curation (Magistral, section 4): make every kept test one the reference solutions
agree on.

For each problem:

1. drop it without running anything when it has no solution (``no_solutions``) or fewer than
   ``min_tests`` tests (``too_few_tests``);
2. run every solution on every test's input in the sandbox (:mod:`megatron_rl.rewards.sandbox`,
   the limits of :class:`~megatron_rl.rewards.code.CodeConfig`), each solution as one task of the
   verifier pool with a hard wall-clock limit; a solution that does not build is left out
   (``solution_build_failed`` note); none left: ``no_working_solution``;
3. per test, over the solutions that built:

   - any run failed (runtime error, time-out, memory) or two outputs differ (compared as the
     verifier compares: by lines of whitespace-separated tokens): drop the test
     (``test_dropped: solution_failed`` / ``test_dropped: solutions_disagree``);
   - all agree with the expected output: keep it (``test_kept``);
   - all agree on another output: with at least ``min_agree_to_repair`` solutions, replace the
     expected output by theirs (``test_repaired``), else drop it
     (``test_dropped: unconfirmed_expected_output``: one solution is no consensus);
   - the test has no expected output (input only, e.g. a generated input): the agreed output
     becomes it (``test_output_generated``);

4. drop the problem when fewer than ``min_tests`` tests remain (``too_few_tests_after_curation``);
5. a problem that names no ``language`` is written once per language of ``languages`` (ids
   ``ID/python``, ``ID/cpp``), its statement asking for that language explicitly -- the reward
   then requires a code block in it.

Function-call tests (HumanEval style) are not curated here: a problem with one is an input error.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from megatron_rl.config import ConfigFieldError, check_range
from megatron_rl.data.problems import DataError, Problem
from megatron_rl.data.report import CurationReport
from megatron_rl.rewards.code import (
    SANDBOX_REASONS,
    CodeConfig,
    compile_cpp,
    ensure_pch,
    interpreter,
    normalise_language,
    outputs_match,
    remove_tree,
)
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool, max_workers
from megatron_rl.rewards.sandbox import run_sandboxed

__all__ = [
    "CodeCurationConfig",
    "SolutionRun",
    "curate_code_problems",
    "curate_tests",
    "run_solution",
    "statement_for_language",
]

LANGUAGE_NAMES = {"python": "Python", "cpp": "C++"}


@dataclass(kw_only=True)
class CodeCurationConfig:
    """Code-test curation settings."""

    min_tests: int = 3  # fewer tests (before or after curation): the problem is dropped
    min_solutions: int = 1  # fewer solutions: the problem is dropped
    min_agree_to_repair: int = 2  # solutions that must agree to overwrite an expected output
    max_solutions: int = 8  # solutions run per problem (the first ones)
    languages: list[str] = field(default_factory=lambda: ["python", "cpp"])  # statement copies
    workers: int = 2  # verifier processes
    code: CodeConfig = field(default_factory=CodeConfig)  # sandbox limits per test

    def __post_init__(self):
        check_range("min_tests", self.min_tests, low=1)
        check_range("min_solutions", self.min_solutions, low=1)
        check_range("min_agree_to_repair", self.min_agree_to_repair, low=1)
        check_range("max_solutions", self.max_solutions, low=1)
        check_range("workers", self.workers, low=1, high=max_workers())  # this machine runs them
        bad = [lang for lang in self.languages if lang not in LANGUAGE_NAMES]
        if bad or not self.languages:
            raise ConfigFieldError(
                "languages", f"must be a non-empty subset of {list(LANGUAGE_NAMES)}, got {self.languages!r}"
            )


@dataclass
class SolutionRun:
    """One solution on one test input."""

    status: str  # "ok" or the failure (runtime_error, timeout, memory, output_limit, ...)
    stdout: str = ""


def run_solution(
    code: str, language: str, inputs: Sequence[str], cfg: CodeConfig
) -> tuple[str, list[SolutionRun]]:
    """Build ``code`` once and run it on every input, each in a fresh sandbox working directory.
    Returns ``("", runs)``, or ``(why, [])`` when it cannot be built. Runs in a pool worker."""
    language = normalise_language(language)
    if language not in LANGUAGE_NAMES:
        return f"unsupported language {language!r}", []
    root = tempfile.mkdtemp(prefix="megatron-rl-curate-")
    os.chmod(root, 0o711)
    try:
        build = os.path.join(root, "build")
        os.mkdir(build, 0o755)
        ro: list[str] = [build]
        if language == "python":
            python, extra = interpreter(cfg)
            with open(os.path.join(build, "main.py"), "w") as f:
                f.write(code)
            argv, ro = [python, "-I", os.path.join(build, "main.py")], ro + extra
        else:
            ok, message, _ = compile_cpp(code, build, cfg)
            if not ok:
                return "compile_error: " + message.strip()[:300], []
            argv = [os.path.join(build, "main")]
        runs = []
        for i, stdin in enumerate(inputs):
            work = os.path.join(root, f"test_{i}")
            os.mkdir(work, 0o700)
            try:
                res = run_sandboxed(
                    argv,
                    stdin=stdin.encode(),
                    workdir=work,
                    timeout_s=cfg.test_timeout_s,
                    memory_mb=cfg.memory_mb,
                    output_limit_bytes=cfg.output_limit_mb << 20,
                    max_processes=cfg.max_processes,
                    mode=cfg.sandbox,
                    extra_ro_paths=ro,
                )
            finally:
                remove_tree(work)
            runs.append(
                SolutionRun("ok", res.stdout.decode(errors="replace"))
                if res.status == "ok"
                else SolutionRun(SANDBOX_REASONS.get(res.status, res.status))
            )
        return "", runs
    finally:
        remove_tree(root)


def curate_tests(
    tests: Sequence[dict], runs: Sequence[Sequence[SolutionRun]], min_agree_to_repair: int
) -> tuple[list[dict], list[str]]:
    """The kept tests (expected outputs repaired or generated where the solutions agree) and one
    event per input test (see the module docstring). ``runs[s][t]``: solution s on test t."""
    kept, events = [], []
    for t, test in enumerate(tests):
        results = [r[t] for r in runs]
        if any(r.status != "ok" for r in results):
            events.append("test_dropped: solution_failed")
            continue
        first = results[0].stdout
        if not all(outputs_match(r.stdout, first) for r in results[1:]):
            events.append("test_dropped: solutions_disagree")
            continue
        expected = test.get("output")
        if expected is None:
            kept.append({**test, "output": first})
            events.append("test_output_generated")
        elif outputs_match(first, expected):
            kept.append(dict(test))
            events.append("test_kept")
        elif len(results) >= min_agree_to_repair:
            kept.append({**test, "output": first, "replaced_output": expected})
            events.append("test_repaired")
        else:
            events.append("test_dropped: unconfirmed_expected_output")
    return kept, events


def statement_for_language(problem: str, language: str) -> str:
    """The statement, asking for a solution in ``language`` explicitly."""
    return f"{problem.rstrip()}\n\nWrite your solution in {LANGUAGE_NAMES[language]}."


def _validate(p: Problem) -> None:
    for k, t in enumerate(p.tests or ()):
        if t.get("type") == "function":
            raise DataError(
                f"problem {p.id!r}: tests[{k}]: function-call tests cannot be "
                "curated (stdin/stdout tests only)"
            )


def curate_code_problems(
    problems: Sequence[Problem],
    cfg: CodeCurationConfig | None = None,
    *,
    pool: VerifierPool | None = None,
    progress: bool = True,
) -> tuple[list[Problem], CurationReport]:
    """Curate every code problem (math problems pass through untouched); see the module
    docstring. Returns the kept problems (one per language where duplicated) and the report."""

    cfg = cfg or CodeCurationConfig()
    report = CurationReport("curate code-tests", total=len(problems))
    code = [p for p in problems if p.task == "code"]
    for p in code:
        _validate(p)
    if any(normalise_language(s["language"]) == "cpp" for p in code for s in p.solutions or ()):
        ensure_pch(cfg.code)  # once, outside the per-task hard time limits
    own = pool is None
    pool = pool or VerifierPool(cfg.workers)
    try:
        jobs: dict[str, list] = {}
        for p in code:
            tests = p.tests or []
            solutions = (p.solutions or [])[: cfg.max_solutions]
            if len(p.solutions or ()) < cfg.min_solutions:
                continue
            if len(tests) < cfg.min_tests:
                continue
            limit = cfg.code.compile_timeout_s + len(tests) * (cfg.code.test_timeout_s + 3) + 15
            jobs[p.id] = [
                pool.submit(
                    run_solution,
                    s["code"],
                    s["language"],
                    [t["input"] for t in tests],
                    cfg.code,
                    timeout_s=limit,
                )
                for s in solutions
            ]
        out: list[Problem] = []
        deadline = pool.deadline()  # every solution run done by then (each within its hard limit)
        for p in tqdm(problems, desc="code-tests", unit="problem", file=sys.stderr, disable=not progress):
            if p.task != "code":
                report.note("math_passed_through")
                report.keep()
                out.append(p)
                continue
            kept = _curate_one(p, jobs.get(p.id), cfg, report, pool, deadline)
            if kept is not None:
                copies = (
                    [kept]
                    if kept.language
                    else [
                        replace(
                            kept,
                            id=f"{kept.id}/{lang}",
                            language=lang,
                            problem=statement_for_language(kept.problem, lang),
                            meta={**kept.meta, "source_id": kept.id},
                        )
                        for lang in cfg.languages
                    ]
                )
                report.keep(len(copies))
                out.extend(copies)
        return out, report
    finally:
        if own:
            pool.close()


def _curate_one(
    p: Problem, futures, cfg: CodeCurationConfig, report: CurationReport, pool: VerifierPool, deadline: float
) -> Problem | None:
    if len(p.solutions or ()) < cfg.min_solutions:
        report.drop("no_solutions" if not p.solutions else "too_few_solutions")
        return None
    if futures is None:
        report.drop("too_few_tests")
        return None
    runs = []
    for f in futures:
        try:
            why, result = pool.result(f, deadline)
        except PoolTaskError as e:
            why, result = f"{e.reason}: {e.detail}", []
        if why:
            report.note(
                "solution_build_failed"
                if not why.startswith("worker_")
                else f"solution_run_failed ({why.split(':')[0]})"
            )
            continue
        runs.append(result)
    if not runs:
        report.drop("no_working_solution")
        return None
    tests, events = curate_tests(p.tests or [], runs, cfg.min_agree_to_repair)
    for event in events:
        report.note(event)
    if len(tests) < cfg.min_tests:
        report.drop("too_few_tests_after_curation")
        return None
    return replace(p, tests=tests)
