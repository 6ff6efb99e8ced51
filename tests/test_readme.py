"""The README stays true: its package tree matches the files, its commands exist, and its code
blocks run as pasted and print what it shows."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_tree() -> set[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        if indent > len(stack):  # a wrapped description line
            continue
        del stack[indent:]
        names = line.strip().split("  ")[0]
        for name in names.split(", "):
            path = "/".join(stack + [name.rstrip("/")])
            paths.add(path)
            if name.endswith("/"):
                stack.append(name.rstrip("/"))
    return paths


def test_every_listed_path_exists():
    missing = [p for p in readme_tree() if not (ROOT / p).exists()]
    assert not missing, f"README lists paths that do not exist: {missing}"


def test_every_module_and_tool_is_listed():
    listed = readme_tree()
    files = [
        p.relative_to(ROOT).as_posix()
        for d in ("megatron_rl", "tools")
        for p in (ROOT / d).rglob("*.py")
        if "__pycache__" not in p.parts
    ]
    unlisted = [f for f in files if f not in listed and not f.endswith("/__init__.py")]
    assert not unlisted, f"README's tree misses: {unlisted}"


def test_readme_commands_match_the_makefile_and_ci():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "make quickstart" in readme and "make test" in readme
    assert re.search(r"^test: ", makefile, re.M) and re.search(r"^quickstart: ", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


# ---------------------------------------------------------------- the README's code blocks, run
#
# Every ```python and ```bash block is run as a user would paste it (Python saved as a script and
# run with python, shell with bash -e) from a folder that holds the repository's examples/, tools/
# and benchmarks/, unless the line before it is `<!-- readme-test: skip, WHY -->`. What is skipped
# that way, and why (the README says it too): `make quickstart` / `make test` (minutes), the GPU
# install, the 8-rank conversion under /models, the SLURM launch, the command-line reference list
# (placeholders; tests/test_cli.py runs the verbs), the colocated and 100-step quick starts
# (minutes of training; GPU and SGLang), `train` on your own model and data (placeholders), the
# curation pipeline (your files, generation servers) and the full GPU check (a CUDA GPU).
# ```yaml, ```json, ```text and unlabelled blocks (diagrams, the tree) are not commands.

FENCE = re.compile(
    r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S
)


def readme_blocks() -> list[tuple[str, str, str | None]]:
    """(language, body, marker or None) of every fenced block, in order."""
    text = (ROOT / "README.md").read_text()
    return [(m["lang"], m["body"], m["marker"]) for m in FENCE.finditer(text)]


def runnable() -> list[tuple[str, str]]:
    return [
        (lang, body)
        for lang, body, marker in readme_blocks()
        if lang in ("python", "bash") and marker is None
    ]


def _block(needle: str) -> tuple[str, str]:
    found = [(lang, body) for lang, body in runnable() if needle in body]
    assert len(found) == 1, f"one runnable README block should contain {needle!r}, found {len(found)}"
    return found[0]


def _run(lang: str, body: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    for name in ("examples", "tools", "benchmarks"):
        if not (cwd / name).exists():
            (cwd / name).symlink_to(ROOT / name)
    script = cwd / ("block.py" if lang == "python" else "block.sh")
    script.write_text(body + "\n")
    cmd = [sys.executable, script.name] if lang == "python" else ["bash", "-e", script.name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_command_block_is_run_here_or_marked_skipped_with_a_reason():
    blocks = readme_blocks()
    for _lang, _body, marker in blocks:
        if marker is not None:
            assert re.fullmatch(r"skip, \S.*", marker), f"marker without a reason: {marker!r}"
    checked = {
        "megatron-rl reward --recipe examples/custom_reward/recipe.yaml",
        "ANSWER = re.compile",
        "from megatron_rl import convert_checkpoint",
        "mlflow runs describe",
        "benchmarks/results.json",
        "bash tools/gpu_check.sh --plan",
    }
    run = runnable()
    unchecked = [body.splitlines()[0] for _, body in run if not any(c in body for c in checked)]
    assert not unchecked, f"README blocks run by no test here (add a check or a skip marker): {unchecked}"
    assert len(run) == len(checked)


def test_custom_reward_block_is_the_example_file_and_runs(tmp_path):
    lang, body = _block("ANSWER = re.compile")
    assert body + "\n" == (ROOT / "examples" / "custom_reward" / "unit_reward.py").read_text()
    proc = _run(lang, body, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_custom_reward_command_scores_as_the_readme_says(tmp_path):
    proc = _run(*_block("megatron-rl reward --recipe examples/custom_reward/recipe.yaml"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    by_reason = {r["reason"]: r["reward"] for r in rows}
    # README: 1.1 for \boxed{2500\text{ m}}, 0.65 wrong_unit, 0.2 a wrong number, 0 without <think>.
    assert by_reason["ok"] == pytest.approx(1.1)
    assert by_reason["wrong_unit"] == pytest.approx(0.65)
    assert by_reason["wrong_answer"] == pytest.approx(0.2)
    assert by_reason["format_error"] == 0
    boxed = [r for r in rows if "\\boxed{2500\\text{ m}}" in r["completion"]]
    assert boxed and all(r["reward"] == pytest.approx(1.1) for r in boxed)


@pytest.mark.slow  # ~30 s on 2 shared cores: the verifier pool starts
def test_python_api_block_prints_what_the_readme_shows(tmp_path):
    lang, body = _block("from megatron_rl import convert_checkpoint")
    shown = re.search(r"print\(results\[0\]\.reward, results\[0\]\.reason\)\s+# (\S+) (\S+)", body)
    assert shown is not None
    proc = _run(lang, body, tmp_path, timeout=180)  # as pasted: a script without a __main__ guard
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == [shown[1], shown[2]]


def test_mlflow_read_back_commands_work_with_the_installed_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from megatron_rl.orchestration.trackers import open_trackers

    trackers = open_trackers(["mlflow"], tmp_path / "RUN", run_name="readme")
    for t in trackers:
        t.config({"loop": {"max_steps": 2}})
        t.log({"reward/mean": 0.25}, step=1)
        t.log({"reward/mean": 0.5}, step=2)
        t.close()
    proc = _run(*_block("mlflow runs describe"), tmp_path)  # no MLFLOW_* from here: the block sets its own
    assert proc.returncode == 0, proc.stderr[-3000:]
    described, history = proc.stdout.rsplit("\n[", 1)
    run = json.loads(described)
    assert run["info"]["status"] == "FINISHED" and run["data"]["params"]["loop.max_steps"] == "2"
    assert run["data"]["metrics"]["reward.mean"] == 0.5
    assert "[" + history.strip() == "[(1, 0.25), (2, 0.5)]"


def test_bench_all_time_is_one_figure_everywhere(tmp_path):
    lang, body = _block("benchmarks/results.json")
    proc = _run(lang, body, tmp_path)
    assert proc.returncode == 0, proc.stderr
    minutes = float(proc.stdout.split()[0])
    readme = (ROOT / "README.md").read_text()
    stated = re.findall(r"`megatron-rl bench all --readme` \(about (\d+) min", readme)
    doc = (ROOT / "tools" / "bench_all.py").read_text()
    assert stated and re.findall(r"whole set takes about (\d+) minutes", doc) == stated
    assert "~8 min on 2" not in readme and "~15 minutes" not in doc
    # The recorded run (benchmarks/results.json) agrees with the stated figure to a quarter.
    assert abs(minutes - float(stated[0])) <= 0.25 * float(stated[0]), (minutes, stated)


def test_bench_all_help_describes_it_in_whole_sentences():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_all.py"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    description = " ".join(proc.stdout.split("\n\n")[1].split())
    assert description.endswith("markers.") and "``benchmarks/RESULTS.md``" in description


def test_gpu_check_plan_output_is_what_the_readme_shows(tmp_path):
    proc = _run(*_block("bash tools/gpu_check.sh --plan"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = [body for lang, body, _ in readme_blocks() if lang == "text" and body.startswith("step ")]
    assert shown == [proc.stdout.rstrip("\n")]
