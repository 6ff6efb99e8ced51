"""The README stays true: its package tree matches the files, and its commands exist."""

import re
from pathlib import Path

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
