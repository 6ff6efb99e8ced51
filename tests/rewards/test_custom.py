"""Your own reward (``reward.custom``): named in a recipe or registered as an entry point, refused at
load when it cannot be had, run in the real verifier pool through the real ``megatron-rl reward``,
and whatever it does wrong scored, never raised."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, ConfigFieldError
from megatron_rl.rewards.compose import RewardConfig, RewardInput, problem_record, score
from megatron_rl.rewards.custom import ENTRY_POINT_GROUP, call_custom, resolve
from tests.docs_pages import section

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_reward"
# examples/custom_reward/samples.jsonl, line by line: right number and unit; no unit; wrong
# number; right in words ("seconds"); no <think> block.
EXAMPLE_REWARDS = [1.1, 0.65, 0.2, 1.1, 0.0]
EXAMPLE_REASONS = ["ok", "wrong_unit", "wrong_answer", "ok", "format_error"]
THINK = "<think>We read the question and work out the value it asks for, step by step.</think>"


def page_section() -> str:
    return section("rewards.md", "## Use your own reward")


def page_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page_section(), re.DOTALL)


def run_page_command(cwd: Path) -> subprocess.CompletedProcess:
    """The page's command, as written, in ``cwd``; ``megatron-rl`` there is this checkout's
    command (``python -m megatron_rl`` with the checkout first on the path), whatever is installed."""
    (command,) = page_blocks("bash")
    this_checkout = (
        f'megatron-rl() {{ PYTHONPATH="{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}" "{sys.executable}" '
        '-m megatron_rl "$@"; }\n'
    )
    return subprocess.run(
        ["bash", "-c", this_checkout + command], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def copy_example(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "custom_reward")
    return tmp_path / "examples" / "custom_reward"


def reward_cli(tmp_path: Path, lines: list[dict], *overrides: str, path: tuple[Path, ...] = ()):
    """``megatron-rl reward`` in a subprocess with ``path`` on PYTHONPATH; (process, output rows)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "reward", "--input", str(inp), "--output", str(out)]
        + ["--workers", "2", "--quiet", *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ":".join(map(str, (*path, ROOT)))},
        timeout=300,
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return proc, rows


def make_dist(where: Path, name: str, entry_points: dict[str, str]) -> Path:
    """A real installed distribution (``NAME-0.1.dist-info``) registering ``entry_points`` in the
    ``megatron_rl.rewards`` group, under ``where`` (a folder to put on sys.path)."""
    info = where / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{eps}")
    return where


# -- the example of docs/rewards.md, through the real command ----------------------------------------------


def test_the_docs_example_is_the_example_and_scores_as_it_says(tmp_path):
    python, yaml_block = page_blocks("python"), page_blocks("yaml")
    assert python == [(EXAMPLE / "unit_reward.py").read_text()]
    assert yaml_block == [(EXAMPLE / "recipe.yaml").read_text()]
    copy_example(tmp_path)
    proc = run_page_command(tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rows] == EXAMPLE_REASONS
    assert [r["reward"] for r in rows] == pytest.approx(EXAMPLE_REWARDS)
    # The record's extra field reached the function: only `unit` tells "2500" from "2500 m".
    assert rows[1]["detail"] == "unit '', expected 'm'" and rows[1]["parts"]["custom"] == pytest.approx(0.45)
    assert rows[0]["correct"] and not rows[1]["correct"]  # a score of 1 is correct, 0.5 is not
    assert "correct" not in rows[0]["parts"]  # replaced: the math check did not run


@pytest.mark.fault("input")
def test_a_typo_in_the_recipe_is_the_documented_error_before_anything_starts(tmp_path):
    recipe = copy_example(tmp_path) / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("unit_reward:score ", "unit_reward:scroe "))
    (quoted,) = re.findall(
        r"`(examples/custom_reward/recipe\.yaml:\d+: reward\.custom: .*?)`", page_section(), re.S
    )
    proc = run_page_command(tmp_path)
    assert proc.returncode == 2
    assert " ".join(quoted.split()) in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr
    assert not (tmp_path / "scored.jsonl").exists()


# -- hostile rewards: scored 0 with the reason, the other samples scored as usual ------------------

HOSTILE = """
import os, signal, time

def score(completion, problem):
    how = problem["behaviour"]
    if how == "raise":
        raise ValueError("no unit in the answer")
    if how == "hang":  # forever, as far as it is concerned
        while True:
            time.sleep(3600)
    if how == "deaf":  # SIGALRM blocked: only the pool's hard limit ends it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            time.sleep(3600)
    if how == "exit":
        os._exit(3)
    if how == "nan":
        return float("nan")
    if how == "inf":
        return {"score": float("inf"), "reason": "ok"}
    if how == "text":
        return "1.0"
    return 1.0
"""
BEHAVIOURS = ["ok", "raise", "ok", "hang", "ok", "exit", "ok", "nan", "inf", "text", "deaf", "ok"]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "hostile_reward.py").write_text(HOSTILE)
    lines = [
        {
            "problem": f"Sample {i}: what is one?",
            "answer": "1",
            "completion": THINK + "It is $\\boxed{1}$.",
            "behaviour": b,
        }
        for i, b in enumerate(BEHAVIOURS)
    ]
    lines.append(
        {
            "problem": "What is one?",
            "answer": "1",
            "completion": "no thinking $\\boxed{1}$",
            "behaviour": "raise",
        }
    )
    proc, rows = reward_cli(
        tmp,
        lines,
        "reward.custom=hostile_reward:score",
        "reward.custom_timeout_s=1",
        "reward.task_timeout_s=4",  # the hard limit, for the one that ignores the soft one
        path=(tmp,),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(rows) == len(lines)
    return rows


def by(rows, behaviour):
    return [r for r in rows if r["behaviour"] == behaviour and r["completion"].startswith("<think>")]


def test_the_well_behaved_samples_all_score(hostile):
    ok = by(hostile, "ok")
    assert len(ok) == BEHAVIOURS.count("ok")
    assert all(r["reason"] == "ok" and r["parts"]["custom"] == 1.0 and r["correct"] for r in ok)


@pytest.mark.fault("crash")
def test_a_raising_reward_scores_its_part_0_with_the_reason(hostile):
    (r,) = by(hostile, "raise")
    assert (
        r["reason"] == "verifier_error" and r["detail"] == "custom: raised ValueError: no unit in the answer"
    )
    assert r["parts"]["custom"] == 0.0 and r["parts"]["format"] == 0.1  # only that part is lost


@pytest.mark.fault("crash")
def test_a_hanging_reward_times_out_with_the_reason(hostile):
    (r,) = by(hostile, "hang")
    assert r["reason"] == "timeout" and r["detail"] == "custom: timed out after 1s"
    assert r["parts"]["custom"] == 0.0 and r["parts"]["format"] == 0.1


@pytest.mark.fault("crash")
def test_a_reward_deaf_to_the_alarm_is_killed_at_the_hard_limit(hostile):
    (r,) = by(hostile, "deaf")
    assert r["reason"] == "worker_timeout" and r["reward"] == 0.0
    assert r["detail"].startswith("custom: no result within the hard limit of 4 s")


@pytest.mark.fault("crash")
def test_a_reward_that_kills_its_process_scores_0_and_the_run_goes_on(hostile):
    (r,) = by(hostile, "exit")
    assert r["reason"] == "worker_crash" and r["reward"] == 0.0
    assert r["detail"] == "custom: verifier process died (exit code 3)"


@pytest.mark.fault("numeric")
def test_non_finite_scores_are_0_with_the_reason(hostile):
    (nan,), (inf,) = by(hostile, "nan"), by(hostile, "inf")
    assert nan["detail"] == "custom: score is nan" and inf["detail"] == "custom: score is inf"
    assert nan["reason"] == inf["reason"] == "verifier_error"
    assert nan["parts"]["custom"] == inf["parts"]["custom"] == 0.0


@pytest.mark.fault("input")
def test_a_score_that_is_no_number_is_0_with_the_reason(hostile):
    (r,) = by(hostile, "text")
    assert r["reason"] == "verifier_error" and r["parts"]["custom"] == 0.0
    assert r["detail"] == "custom: score must be a number or a dict with 'score', got str '1.0'"


def test_a_format_failure_stops_before_the_custom_reward(hostile):
    (r,) = [r for r in hostile if not r["completion"].startswith("<think>")]
    assert r["reason"] == "format_error" and r["reward"] == 0.0  # "raise" was never called


# -- entry points -------------------------------------------------------------------------------


def test_a_reward_registered_as_an_entry_point_resolves_by_name_in_the_cli(tmp_path):
    # The dist-info declares what examples/custom_reward/pyproject.toml declares, as pip would.
    declared = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["entry-points"]
    site = make_dist(tmp_path / "site", "unit-reward", declared[ENTRY_POINT_GROUP])
    samples = [json.loads(x) for x in (EXAMPLE / "samples.jsonl").read_text().splitlines()]
    proc, rows = reward_cli(
        tmp_path, samples, "reward.custom=unit_match", "reward.custom_weight=0.9", path=(site, EXAMPLE)
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["reason"] for r in rows] == EXAMPLE_REASONS
    assert [r["reward"] for r in rows] == pytest.approx(EXAMPLE_REWARDS)


@pytest.mark.fault("input")
def test_registered_names_that_cannot_be_had_are_errors_naming_them(tmp_path, monkeypatch):
    make_dist(tmp_path, "first", {"twice": "unit_reward:score", "gone": "not_installed_zq:score"})
    make_dist(tmp_path, "second", {"twice": "other_module_zq:score"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    with pytest.raises(ConfigFieldError, match=r"'twice' is registered more than once.*by first.*by second"):
        resolve("twice")
    with pytest.raises(
        ConfigFieldError, match=r"registered reward 'gone' \(= not_installed_zq:score\).*no module"
    ):
        resolve("gone")
    with pytest.raises(
        ConfigFieldError, match=r"no reward is registered as 'absent'.*registered: .*gone.*twice"
    ):
        resolve("absent")


# -- bad reward.custom values: refused at load, naming the recipe's line and the field -------------

BAD_MODULES = {
    "broken_on_import_zq": "X = 1\nY = 1 / 0\n",
    "syntax_bad_zq": "def score(completion, problem)\n    return 1\n",
    "missing_dep_zq": "import not_installed_dep_zq\n",
    "one_arg_zq": "def score(completion):\n    return 1.0\n",
    "async_zq": "async def score(completion, problem):\n    return 1.0\n",
}


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "value, message",
    [
        (
            "no_such_module_zq:score",
            r"'no_such_module_zq:score': no module named 'no_such_module_zq' \(install it, or put",
        ),
        ("unit_reward:scroe", r"'unit_reward' has no attribute 'scroe' \(callables there: score\)"),
        ("unit_reward:UNITS", r"'unit_reward:UNITS' is a dict, not a function"),
        (
            "unit_reward.score",
            r"no reward is registered as 'unit_reward.score'.*did you mean 'unit_reward:score'\?",
        ),
        ("unit_reward:score:x", r"expected 'module:function', got 'unit_reward:score:x'"),
        ("", r"must be 'module:function' or the name of a registered reward, got ''"),
        (
            "broken_on_import_zq:score",
            r"raised ZeroDivisionError: division by zero \(.*broken_on_import_zq.py:2\)",
        ),
        ("syntax_bad_zq:score", r"raised SyntaxError: .*\(.*syntax_bad_zq.py:1\)"),
        (
            "missing_dep_zq:score",
            r"importing 'missing_dep_zq' failed: No module named 'not_installed_dep_zq'",
        ),
        (
            "one_arg_zq:score",
            r"'one_arg_zq:score'\(completion\) cannot be called as fn\(completion, problem\)",
        ),
        ("async_zq:score", r"'async_zq:score' is an async function"),
    ],
)
def test_bad_custom_values_are_refused_at_load_naming_line_and_field(tmp_path, monkeypatch, value, message):
    from megatron_rl.orchestration.recipe import load_config  # the whole recipe, as train reads it

    for name, source in BAD_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"reward:\n  workers: 1\n  custom: {json.dumps(value)}\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert str(e.value).startswith(f"{recipe}:3: reward.custom: ")
    assert re.search(message, str(e.value)), str(e.value)


@pytest.mark.fault("input")
def test_a_bad_override_is_one_line_and_exit_status_2(tmp_path):
    proc, rows = reward_cli(
        tmp_path, [{"problem": "p", "answer": "1", "completion": "c"}], "reward.custom=nowhere_zq:f"
    )
    assert proc.returncode == 2 and not rows and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().count("\n") == 0
        and "reward.custom: 'nowhere_zq:f': no module named" in proc.stderr
    )


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"custom_mode": "instead"}, "custom_mode: must be one of"),
        ({"custom_weight": -1.0}, "custom_weight: must be in"),
        ({"custom_timeout_s": 0.0}, "custom_timeout_s: must be in"),
        ({"task_timeout_s": 5.0, "custom_timeout_s": 10.0}, "custom_timeout_s: must be below task_timeout_s"),
    ],
)
def test_custom_settings_are_checked(monkeypatch, fields, message):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    with pytest.raises(ConfigFieldError, match=message):
        RewardConfig(custom="unit_reward:score", **fields)


# -- how it combines, and what it is given (in this process) ---------------------------------------


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def test_add_mode_keeps_the_math_check_and_adds_the_weighted_part(example_on_path):
    record = {"problem": "How many metres are in 2.5 kilometres?", "answer": "2500", "unit": "m"}
    inp = RewardInput(
        problem=record["problem"],
        completion=THINK + "It is $\\boxed{2500}$.",
        task="math",
        answer="2500",
        record=record,
    )
    r = score(inp, RewardConfig(custom="unit_reward:score", custom_mode="add", custom_weight=0.5))
    assert r.parts == pytest.approx(
        {"format": 0.1, "correct": 0.9, "custom": 0.25, "length": 0.0, "language": 0.1}
    )
    assert r.reward == pytest.approx(1.35) and r.correct and r.reason == "ok"  # the math check's verdict
    assert r.info["custom"] == {"score": 0.5, "reason": "wrong_unit", "detail": "unit '', expected 'm'"}


def test_without_a_record_the_function_gets_the_fields_the_reward_knows():
    inp = RewardInput(problem="What is one?", completion="c", task="math", answer="1")
    assert problem_record(inp) == {"problem": "What is one?", "task": "math", "answer": "1"}
    full = {"problem": "What is one?", "answer": "1", "unit": "m", "source": {"book": 3}}
    assert (
        problem_record(
            RewardInput(problem="What is one?", completion="c", task="math", answer="1", record=full)
        )
        is full
    )


def test_dict_results_are_checked_and_labels_kept():
    def run(value):
        return call_custom(lambda c, p: value, "c", {}, timeout_s=5)

    assert (run(True).score, run(True).correct) == (1.0, True)
    assert (run(0.3).reason, run(0.3).correct) == ("wrong_answer", False)
    r = run({"score": 0.2, "reason": "close_enough", "detail": "off by 1%", "correct": True})
    assert (r.score, r.reason, r.detail, r.correct, r.failed) == (
        0.2,
        "close_enough",
        "off by 1%",
        True,
        False,
    )
    for bad, why in (
        ({"scor": 1}, "unknown key 'scor'"),
        ({"reason": "ok"}, "has no 'score'"),
        ({"score": 1, "correct": "yes"}, "'correct' must be true or false"),
        ({"score": 1, "reason": "the unit is wrong"}, "'reason' must be a short label"),
        (None, "score must be a number or a dict with 'score', got NoneType"),
    ):
        r = run(bad)
        assert r.failed and r.score == 0.0 and r.reason == "verifier_error" and why in r.detail, r.detail


@pytest.mark.fault("crash")
def test_the_soft_limit_interrupts_and_puts_the_alarm_handler_back():
    before = signal.getsignal(signal.SIGALRM)

    def stuck(completion, problem):
        try:
            time.sleep(3600)
        except Exception:  # noqa: BLE001 -- the user's catch-all does not swallow the limit
            return 1.0

    r = call_custom(stuck, "c", {}, timeout_s=0.2)
    assert r.failed and r.reason == "timeout" and r.detail == "custom: timed out after 0.2s"
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
