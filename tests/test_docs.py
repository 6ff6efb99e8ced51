"""The documentation stays true: the README is a front page (at most 200 lines) whose links land on
pages that exist, the package tree in docs/contributing.md matches the files, the config reference
is what the config dataclasses say, and every command block of the README and of docs/ is run here
(as pasted, and compared with the output the page shows) or marked skipped with a reason."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.docs_pages import DOCS, ROOT, blocks, pages, section, text


def layout_tree() -> set[str]:
    block = section("contributing.md", "## Layout").split("```", 2)[1]
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
    missing = [p for p in layout_tree() if not (ROOT / p).exists()]
    assert not missing, f"docs/contributing.md lists paths that do not exist: {missing}"


def test_every_module_and_tool_is_listed():
    listed = layout_tree()
    files = [
        p.relative_to(ROOT).as_posix()
        for d in ("megatron_rl", "tools")
        for p in (ROOT / d).rglob("*.py")
        if "__pycache__" not in p.parts
    ]
    unlisted = [f for f in files if f not in listed and not f.endswith("/__init__.py")]
    assert not unlisted, f"docs/contributing.md's tree misses: {unlisted}"


def test_readme_is_a_front_page_whose_links_land():
    readme = text("README.md")
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    # every page of the site is reachable from the front page
    linked = {Path(t).name for t in targets if t.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.name not in linked)
    assert not unlinked, f"README links to no docs page named {unlinked}"


def test_config_reference_is_what_the_dataclasses_say():
    from megatron_rl.cli.config_reference import reference_markdown
    from megatron_rl.orchestration.recipe import RunConfig

    page = text("config.md")
    assert page == reference_markdown(), (
        "docs/config.md is stale: megatron-rl config --reference > docs/config.md"
    )
    # and independently of the generator: every field of every section, nested ones expanded
    expected = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
                walk(typing.get_args(hint)[0], f"{prefix}{f.name}[].")
            else:
                expected.add(f"{prefix}{f.name}")

    walk(RunConfig, "")
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    assert listed == expected, (sorted(expected - listed), sorted(listed - expected))
    assert len(expected) > 150


def test_readme_commands_match_the_makefile_and_ci():
    readme = text("README.md")
    makefile = (ROOT / "Makefile").read_text()
    assert "make quickstart" in readme and "make test" in readme
    assert re.search(r"^test: ", makefile, re.M) and re.search(r"^quickstart: ", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


# ------------------------------------------------------------- the pages' code blocks, run
#
# Every ```python and ```bash block of the README and of docs/ is run as a user would paste it
# (Python saved as a script and run with python, shell with bash -e) from a folder that holds the
# repository's examples/, tools/ and benchmarks/, unless the line before it is
# `<!-- doc-test: skip, WHY -->`. A block with a test of its own below (CHECKED) is run there;
# every other one by test_every_other_command_block_runs: it must exit 0 and, when the page shows
# its output (a ```text block marked `<!-- doc-test: output -->` right after it), print exactly
# that. What is skipped, and why, each marker says: minutes of training or of tests, a CUDA GPU,
# SGLang, SLURM, several nodes, or placeholders for your own files and servers.
# ```yaml, ```json, ```text and unlabelled blocks (diagrams, the tree) are not commands.

#: Blocks with a test of their own in this file (a needle each block holds).
CHECKED = {
    "megatron-rl reward --recipe examples/custom_reward/recipe.yaml",
    "ANSWER = re.compile",
    "class Retry:",
    "from megatron_rl import convert_checkpoint",
    "mlflow runs describe",
    "benchmarks/results.json",
    "bash tools/gpu_check.sh --plan",
}


def all_blocks() -> list[tuple[str, int, str, str, str | None]]:
    """(page, index, language, body, marker) of every fenced block of every page."""
    out = []
    for path in pages():
        name = path.relative_to(ROOT).as_posix()
        for i, (lang, body, marker) in enumerate(blocks(path.read_text())):
            out.append((name, i, lang, body, marker))
    return out


def runnable() -> list[tuple[str, str]]:
    return [
        (lang, body)
        for _, _, lang, body, marker in all_blocks()
        if lang in ("python", "bash") and marker is None
    ]


def _block(needle: str) -> tuple[str, str]:
    found = [(lang, body) for lang, body in runnable() if needle in body]
    assert len(found) == 1, f"one runnable block should contain {needle!r}, found {len(found)}"
    return found[0]


def _others() -> list[tuple[str, int, str, str, str | None]]:
    """Runnable blocks without a test of their own, each with the output its page shows (or None)."""
    out = []
    every = all_blocks()
    for k, (page, i, lang, body, marker) in enumerate(every):
        if lang not in ("python", "bash") or marker is not None or any(c in body for c in CHECKED):
            continue
        nxt = every[k + 1] if k + 1 < len(every) else None
        shown = nxt[3] if nxt and nxt[0] == page and nxt[2] == "text" and nxt[4] == "output" else None
        out.append((page, i, lang, body, shown))
    return out


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
    every = all_blocks()
    for page, i, lang, _body, marker in every:
        if marker is not None:
            assert re.fullmatch(r"skip, \S.*|output", marker), f"{page} block {i}: marker {marker!r}"
            if marker == "output":
                assert lang == "text", f"{page} block {i}: an output marker on a {lang} block"
    for page in pages():
        assert "<!-- readme-test:" not in page.read_text(), f"{page}: <!-- readme-test: is now <!-- doc-test:"
    run = runnable()
    for needle in CHECKED:  # each dedicated check still finds its block
        assert sum(needle in body for _, body in run) == 1, needle
    assert _others(), "no block is run by the generic test: the check would check nothing"


@pytest.mark.parametrize(
    "page,index,lang,body,shown", [pytest.param(*b, id=f"{b[0]}:{b[1]}") for b in _others()]
)
def test_every_other_command_block_runs(tmp_path, page, index, lang, body, shown):
    proc = _run(lang, body, tmp_path)
    assert proc.returncode == 0, f"{page} block {index}:\n{body}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    if shown is not None:
        assert proc.stdout.rstrip("\n") == shown, f"{page} block {index} printed:\n{proc.stdout}"


def test_custom_reward_block_is_the_example_file_and_runs(tmp_path):
    lang, body = _block("ANSWER = re.compile")
    assert body + "\n" == (ROOT / "examples" / "custom_reward" / "unit_reward.py").read_text()
    proc = _run(lang, body, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_multi_turn_block_is_the_example_environment(tmp_path):
    lang, body = _block("class Retry:")
    assert body + "\n" == (ROOT / "examples" / "multi_turn" / "retry_env.py").read_text()
    proc = _run(lang, body, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_custom_reward_command_scores_as_the_page_says(tmp_path):
    proc = _run(*_block("megatron-rl reward --recipe examples/custom_reward/recipe.yaml"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    by_reason = {r["reason"]: r["reward"] for r in rows}
    # docs/rewards.md: 1.1 for \boxed{2500\text{ m}}, 0.65 wrong_unit, 0.2 a wrong number, 0 without <think>.
    assert by_reason["ok"] == pytest.approx(1.1)
    assert by_reason["wrong_unit"] == pytest.approx(0.65)
    assert by_reason["wrong_answer"] == pytest.approx(0.2)
    assert by_reason["format_error"] == 0
    boxed = [r for r in rows if "\\boxed{2500\\text{ m}}" in r["completion"]]
    assert boxed and all(r["reward"] == pytest.approx(1.1) for r in boxed)


@pytest.mark.slow  # ~30 s on 2 shared cores: the verifier pool starts
def test_python_api_block_prints_what_the_page_shows(tmp_path):
    lang, body = _block("from megatron_rl import convert_checkpoint")
    shown = re.search(r"print\(results\[0\]\.reward, results\[0\]\.reason\)\s+# (\S+) (\S+)", body)
    assert shown is not None
    proc = _run(lang, body, tmp_path, timeout=180)  # as pasted: a script without a __main__ guard
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == [shown[1], shown[2]]


def test_mlflow_read_back_commands_work_with_the_installed_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from megatron_rl.orchestration.trackers import open_trackers

    trackers = open_trackers(["mlflow"], tmp_path / "RUN", run_name="docs")
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
    stated = re.findall(r"`megatron-rl bench all --docs` \(about (\d+) min", text("performance.md"))
    doc = (ROOT / "tools" / "bench_all.py").read_text()
    assert stated and re.findall(r"whole set takes about (\d+) minutes", doc) == stated
    assert "~15 minutes" not in doc
    # The recorded run (benchmarks/results.json) agrees with the stated figure to a quarter.
    assert abs(minutes - float(stated[0])) <= 0.25 * float(stated[0]), (minutes, stated)


def test_bench_all_help_describes_it_in_whole_sentences():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_all.py"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    description = " ".join(proc.stdout.split("\n\n")[1].split())
    assert description.endswith("markers.") and "``benchmarks/RESULTS.md``" in description


def test_gpu_check_plan_output_is_what_the_page_shows(tmp_path):
    proc = _run(*_block("bash tools/gpu_check.sh --plan"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = [
        body
        for lang, body, _ in blocks(text("gpu-cluster.md"))
        if lang == "text" and body.startswith("step ")
    ]
    assert shown == [proc.stdout.rstrip("\n")]
