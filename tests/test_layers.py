"""The package's imports point down the written layer order (megatron_rl/layers.py), with no cycle.

Every ``import`` and ``from ... import`` of every module is read from its source (module-level,
function-local and ``TYPE_CHECKING`` ones alike), resolved to a module of megatron_rl, and judged by
:func:`megatron_rl.layers.check_import`. A failure names the file and the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_rl import layers

PACKAGE = Path(layers.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path):
    """``(line, imported module, local)`` for every import in ``path``; ``local`` is true for an
    import inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    local = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in local
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield node.lineno, target, id(node) in local
            # ``from megatron_rl import fileio`` imports the module megatron_rl.fileio
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*sub.split(".")) / "__init__.py"
                ).exists():
                    yield node.lineno, sub, id(node) in local


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _edges() -> list[tuple[str, int, str, str, bool]]:
    out = []
    for path in _sources():
        me = _module_name(path)
        for line, target, local in _imports(path):
            if target == "megatron_rl" or target.startswith("megatron_rl."):
                out.append((str(path.relative_to(PACKAGE.parent)), line, me, target, local))
    return out


def test_every_part_of_the_package_has_a_layer():
    parts = {layers.part_of(_module_name(p)) for p in _sources()}
    missing = sorted(p for p in parts if p not in layers.LAYER_OF)
    assert not missing, f"parts of megatron_rl with no layer in megatron_rl/layers.py: {missing}"
    stale = sorted(set(layers.LAYER_OF) - parts)
    assert not stale, f"megatron_rl/layers.py names parts that do not exist: {stale}"


def test_imports_point_down_the_layers():
    bad = [
        f"{file}:{line}: {me} imports {target}: {why}"
        for file, line, me, target, _ in _edges()
        if (why := layers.check_import(me, target)) is not None
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_cycle_between_parts():
    graph: dict[str, set[str]] = {}
    for _, _, me, target, _ in _edges():
        a, b = layers.part_of(me), layers.part_of(target)
        if a != b and b != "":
            graph.setdefault(a, set()).add(b)

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for p in sorted(graph) if (c := cycle_from(p))]
    assert not cycles, "import cycles between parts: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_function_local_import_says_why():
    """A function-local import is allowed only to keep a heavy or optional dependency off the
    paths that do not need it (the CLI parser, a verifier worker's start); each one carries a
    ``# lazy: reason`` comment."""
    bad = []
    for path in _sources():
        text = path.read_text().splitlines()
        spans = {
            n.lineno: n.end_lineno
            for n in ast.walk(ast.parse("\n".join(text)))
            if isinstance(n, (ast.Import, ast.ImportFrom))
        }
        for line, target, local in _imports(path):
            if local and "# lazy:" not in "\n".join(text[line - 1 : spans[line]]):
                bad.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: function-local import of "
                    f"{target} without '# lazy: why'"
                )
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "me,target,ok",
    [
        ("megatron_rl.types", "megatron_rl.algorithms.filtering", False),  # up
        ("megatron_rl.training.trainer", "megatron_rl.generation.protocol", False),  # across a layer
        ("megatron_rl.training.trainer", "megatron_rl.batching.collate", True),  # down
        ("megatron_rl.orchestration.loop", "megatron_rl.orchestration.rollouts", True),  # inside
        ("megatron_rl.hf.names", "megatron_rl.fileio", True),
    ],
)
def test_the_rule_itself(me, target, ok):
    assert (layers.check_import(me, target) is None) is ok


#: The most lines a file of the package or of tools/ may have: past it, a file holds more than one
#: concept and is split along its seams (docs/contributing.md).
MAX_LINES = 800


def test_no_file_of_the_package_or_tools_is_over_800_lines():
    tools = PACKAGE.parent / "tools"
    files = [*_sources(), *sorted(tools.glob("*.py"))]
    over = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not over, f"files over {MAX_LINES} lines (split them along their seams): {over}"
