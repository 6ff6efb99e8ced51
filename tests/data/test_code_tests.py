"""Code-test curation: the agreement rules on hand-made runs, then the shipped sample run for
real in the sandbox (Python and C++ solutions), and the curated tests used by the real verifier."""

from __future__ import annotations

import shutil

import pytest

from megatron_rl.data.benchmarks import sample_file
from megatron_rl.data.code_tests import (
    CodeCurationConfig,
    SolutionRun,
    curate_code_problems,
    curate_tests,
    run_solution,
)
from megatron_rl.data.problems import DataError, Problem, read_problems
from megatron_rl.rewards.code import CodeConfig, verify_code
from megatron_rl.rewards.sandbox import sandbox_problem

needs_sandbox = pytest.mark.skipif(
    sandbox_problem("auto") is not None, reason=f"no working sandbox: {sandbox_problem('auto')}"
)
FAST = CodeConfig(test_timeout_s=2.0)


def ok(out: str) -> SolutionRun:
    return SolutionRun("ok", out)


TESTS = [
    {"input": "a", "output": "1\n"},
    {"input": "b", "output": "2\n"},
    {"input": "c", "output": "3\n"},
    {"input": "d"},
    {"input": "e", "output": "5\n"},
]


def test_agreement_rules():
    runs = [
        [ok("1\n"), ok("2\n"), ok("4"), ok("x\n"), SolutionRun("timeout")],
        [ok("1  \n"), ok("9\n"), ok("4\n"), ok("x"), ok("5\n")],
    ]
    kept, events = curate_tests(TESTS, runs, min_agree_to_repair=2)
    assert events == [
        "test_kept",
        "test_dropped: solutions_disagree",
        "test_repaired",
        "test_output_generated",
        "test_dropped: solution_failed",
    ]
    assert kept[0] == TESTS[0]
    assert kept[1] == {"input": "c", "output": "4", "replaced_output": "3\n"}
    assert kept[2] == {"input": "d", "output": "x\n"}


def test_one_solution_cannot_overrule_an_expected_output():
    kept, events = curate_tests(TESTS[:3], [[ok("1\n"), ok("2\n"), ok("4\n")]], min_agree_to_repair=2)
    assert events[2] == "test_dropped: unconfirmed_expected_output" and len(kept) == 2
    kept, _ = curate_tests(TESTS[:3], [[ok("1\n"), ok("2\n"), ok("4\n")]], min_agree_to_repair=1)
    assert kept[2]["output"] == "4\n"


@needs_sandbox
def test_run_solution_reports_outputs_and_failures(pool):
    why, runs = pool.submit(
        run_solution,
        "import sys\nx = int(input())\nprint(10 // x)\n",
        "python",
        ["2\n", "0\n", "oops\n"],
        FAST,
    ).result()
    assert why == "" and [r.status for r in runs] == ["ok", "runtime_error", "runtime_error"]
    assert runs[0].stdout == "5\n"
    why, runs = pool.submit(run_solution, "int main( {", "cpp", ["1\n"], FAST).result()
    assert why.startswith("compile_error") and runs == []


@needs_sandbox
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_the_shipped_sample_end_to_end(pool):
    problems = read_problems(sample_file("code_raw.jsonl"))
    kept, report = curate_code_problems(problems, CodeCurationConfig(code=FAST), pool=pool, progress=False)
    by_id = {p.id: p for p in kept}
    assert list(by_id) == [
        "sum/python",
        "sum/cpp",
        "generated-outputs",
        "crash-on-one/python",
        "crash-on-one/cpp",
    ]
    # The wrong expected output (99) was replaced by what all three solutions print.
    summed = by_id["sum/python"]
    assert [t["output"].strip() for t in summed.tests] == ["6", "-5", "100", "2000000000"]
    assert summed.tests[2]["replaced_output"] == "99\n"
    assert summed.problem.endswith("Write your solution in Python.") and summed.language == "python"
    assert by_id["sum/cpp"].problem.endswith("Write your solution in C++.")
    assert by_id["sum/cpp"].meta["source_id"] == "sum"
    assert [t["output"] for t in by_id["generated-outputs"].tests] == ["cba\n", "racecar\n", "yx\n"]
    assert [t["input"] for t in by_id["crash-on-one/python"].tests] == ["7 2\n", "9 3\n", "-7 2\n"]
    # Max vs min: the two solutions disagree on every test, so none is left.
    assert dict(report.dropped) == {"too_few_tests_after_curation": 1, "no_solutions": 1, "too_few_tests": 1}
    assert report.notes["test_repaired"] == 1 and report.notes["test_output_generated"] == 3
    assert report.notes["test_dropped: solutions_disagree"] == 3
    assert report.notes["test_dropped: solution_failed"] == 1
    # The repaired tests are what the reward's verifier now checks against.
    solution = problems[0].solutions[0]["code"]
    assert verify_code(solution, "python", summed.tests, FAST).correct
    assert not verify_code(solution, "python", problems[0].tests, FAST).correct


def test_function_tests_are_refused_with_the_problem_named(pool):
    p = Problem(
        id="he",
        problem="def f",
        task="code",
        tests=[{"type": "function", "test": "", "entry_point": "f"}] * 3,
        solutions=[{"language": "python", "code": "def f(): pass"}],
    )
    with pytest.raises(DataError, match=r"problem 'he': tests\[0\]: function-call tests"):
        curate_code_problems([p], pool=pool, progress=False)
