"""The config reference, generated from the config dataclasses themselves: ``megatron-rl config
--reference`` prints it as Markdown (``docs/config.md`` is its output; ``tests/test_docs.py``
regenerates it and fails when the two differ).

For every field of every section of :class:`~megatron_rl.orchestration.recipe.RunConfig`, nested
sections included (``trainer.parallel``, ``trainer.optim``): its dotted name, its type, its
default, what it means (the comment written beside or above the field in the source) and the
checks it gets when a recipe is read -- read from the section's own methods (its
``__post_init__`` and the methods it calls): each ``check_range`` / ``check_choice`` on the field
and each ``raise ConfigFieldError("field", ...)`` with the condition it is raised under. Nothing
here is written twice: a new field, a changed default or a new check changes the reference.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any

import yaml

__all__ = ["Field", "fields_of", "reference_markdown"]


@dataclasses.dataclass(frozen=True)
class Field:
    """One recipe field as the reference shows it."""

    name: str  # dotted, from the recipe's root: "trainer.optim.lr"
    type: str  # as annotated in the source
    default: str  # YAML, as a recipe would write it
    doc: str  # the comment beside or above the field
    checks: tuple[str, ...]  # what the loader refuses, one phrase each


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the one on the field's line, else the comment lines just above."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    body = _class_node(cls)
    on_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            on_line[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        trailing = [on_line[n] for n in range(node.lineno, end + 1) if n in on_line]
        above: list[str] = []
        n = node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, on_line.get(n, ""))
            n -= 1
        out[node.target.id] = " ".join(above + trailing).strip()
    return out


def _strip_self(text: str) -> str:
    return text.replace("self.", "")


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (its factory called)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"config field {f.name} has no default")


def _class_node(cls: type) -> ast.ClassDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    return node


def _range_phrase(call: ast.Call) -> str:
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    low, high = kw.get("low"), kw.get("high")
    low_open, high_open = _is_true(kw.get("low_open")), _is_true(kw.get("high_open"))
    lo = f"{'(' if low_open else '['}{_strip_self(ast.unparse(low))}" if low is not None else "(-inf"
    hi = f"{_strip_self(ast.unparse(high))}{')' if high_open else ']'}" if high is not None else "inf)"
    return f"in {lo}, {hi}, finite"


def _choices_phrase(node: ast.expr) -> str:
    if isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) for e in node.elts):
        return "one of " + ", ".join(_yaml(e.value) for e in node.elts)  # type: ignore[attr-defined]
    return f"one of {_strip_self(ast.unparse(node))}"


def _checks(cls: type) -> dict[str, list[str]]:
    """Field name (first component of the name the check reports) -> the checks, in source order."""
    out: dict[str, list[str]] = {}
    source = textwrap.dedent(inspect.getsource(cls))
    tree = ast.parse(source)
    module_globals = vars(inspect.getmodule(cls))

    def add(name: str, phrase: str) -> None:
        key = name.split(".")[0].split("[")[0]
        if phrase not in out.setdefault(key, []):
            out[key].append(phrase)

    def names(arg: ast.expr, bound: dict[str, list[str]]) -> list[str]:
        """The field names a check's first argument stands for: a string, or a loop variable over strings."""
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [arg.value]
        if isinstance(arg, ast.Name) and arg.id in bound:
            return bound[arg.id]
        return []

    def visit(node: ast.AST, conditions: list[str], bound: dict[str, list[str]]) -> None:
        when = f" (when `{' and '.join(conditions)}`)" if conditions else ""
        if isinstance(node, ast.If):
            cond = _strip_self(ast.unparse(node.test))
            for child in node.body:
                visit(child, [*conditions, cond], bound)
            for child in node.orelse:
                visit(child, [*conditions, f"not ({cond})"], bound)
            return
        if isinstance(node, ast.For):
            inner = dict(bound)
            if isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)):
                values = [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]
                if values and all(isinstance(v, str) for v in values):
                    inner[node.target.id] = [str(v) for v in values]
            for child in node.body:
                visit(child, conditions, inner)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            func, first = node.func.id, node.args[0]
            for name in names(first, bound):
                if func == "check_range":
                    add(name, _range_phrase(node) + when)
                elif func == "check_choice" and len(node.args) > 2:
                    add(name, _choices_phrase(node.args[2]) + when)
            if (
                func.startswith("check_")
                and isinstance(first, ast.Attribute)
                and isinstance(first.value, ast.Name)
                and first.value.id == "self"
            ):
                checker = module_globals.get(func)
                summary = (
                    (inspect.getdoc(checker) or "").split("\n\n")[0].replace("\n", " ") if checker else ""
                )
                add(first.attr, f"`{func}`" + (f": {summary}" if summary else "") + when)
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call = node.exc
            if isinstance(call.func, ast.Name) and call.func.id == "ConfigFieldError" and call.args:
                for name in names(call.args[0], bound):
                    if conditions:
                        add(name, f"refused when `{' and '.join(conditions)}`")
                    else:
                        add(name, "refused as the section's checks say (see its source)")
            return
        for sub in ast.iter_child_nodes(node):
            visit(sub, conditions, bound)

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (
            node.name == "__post_init__" or not node.name.startswith("__")
        ):
            for stmt in node.body:
                visit(stmt, [], {})
    return out


def _yaml(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"' if value == "" or value.strip() != value else value
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _literal_choices(hint: Any) -> tuple[object, ...]:
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return ()


def fields_of(cls: type, prefix: str = "") -> list[Field]:
    """Every field of ``cls`` (a config dataclass), nested config dataclasses expanded."""
    hints = typing.get_type_hints(cls)
    comments, checks = _comments(cls), _checks(cls)
    annotations = {
        n.target.id: ast.unparse(n.annotation)
        for n in _class_node(cls).body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    out: list[Field] = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        value = _default(f)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.extend(fields_of(type(value), f"{name}."))
            continue
        found = list(checks.get(f.name, []))
        choices = _literal_choices(hints.get(f.name))
        if choices and not any(c.startswith("one of") for c in found):
            found.insert(0, "one of " + ", ".join(_yaml(c) for c in choices))
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            default = f"{len(value)} entries"
        else:
            default = _yaml(value)
        out.append(
            Field(
                name=name,
                type=annotations.get(f.name, str(hints.get(f.name))),
                default=default,
                doc=comments.get(f.name, ""),
                checks=tuple(found),
            )
        )
    return out


_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data):`~?([^`]+)`")


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: Sphinx roles as code, no pipe or line break."""
    return _ROLE.sub(r"`\1`", text).replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """The whole reference, as ``docs/config.md`` holds it."""
    from megatron_rl.orchestration.recipe import RunConfig  # lazy: the recipe imports torch

    parts = [
        "# Config reference",
        "",
        "<!-- Generated by `megatron-rl config --reference > docs/config.md`; do not edit by hand:",
        "     tests/test_docs.py fails when this page and the config dataclasses differ. -->",
        "",
        "Every field a recipe can set, section by section, with its type, its default (Magistral's",
        "values), what it means and what the loader refuses. Every field is also checked for its",
        "type (an integer where `int` is written, true/false for `bool`), and every number must be",
        "finite. A recipe sets only what differs from these defaults; `key.sub=value` on the command",
        "line sets one field (see [Recipes](recipes.md)). Each check below is read from the",
        "section's source; the error it raises names the file, the line and the field.",
        "",
        "**On a real pretrained model** (`examples/quickstart_smollm2.yaml`, SmolLM2-135M-Instruct),",
        "the fields that matter first: `reward.l_max` and `reward.l_cache` in that model's tokens",
        "(its completions, not the tiny model's), and `fleet.max_len` at least the longest prompt",
        "plus `reward.l_max` (`train` checks it before it starts); `trainer.optim.lr` far below a",
        "from-scratch model's (2e-5 there, 1e-4 for the tiny quick start); `data.system_prompt`, the",
        "prompt its cold start trained on; `reward.think_tags`, which need not be single tokens of",
        "its tokenizer (the format check reads text: SmolLM2 writes `<think>` as `<`, `think`, `>`),",
        "only the same in SFT, RL and evaluation; `batching.token_budget`, the tokens of one",
        "micro-batch (activation memory); and `loop.max_dropped_batches`, since a real model's",
        "early groups are often all right or all wrong.",
        "",
    ]
    for f in dataclasses.fields(RunConfig):
        section_type = typing.get_type_hints(RunConfig)[f.name]
        instance = _default(f)
        if isinstance(instance, list):  # the curriculum: a list of stages
            (stage_cls,) = typing.get_args(section_type)
            cls, prefix, title = stage_cls, f"{f.name}[].", f"`{f.name}` (a list of stages)"
        else:
            cls, prefix, title = type(instance), f"{f.name}.", f"`{f.name}`"
        doc = inspect.getdoc(cls) or ""
        parts += [f"## {title}", "", f"`{cls.__module__}.{cls.__qualname__}`: {doc.splitlines()[0]}", ""]
        if isinstance(instance, list):
            parts += [
                "Each stage sets only the fields it names; every value it sets is checked, when the",
                "recipe is read, by the checks of the field it sets (`l_max` as `reward.l_max`,",
                "`n_batch` as `loop.n_batch`, ...) over what the stages before it left.",
                "",
            ]
        parts += ["| field | type | default | what it is | checks |", "|---|---|---|---|---|"]
        for fld in fields_of(cls, prefix):
            checks = "; ".join(fld.checks) or "type"
            parts.append(
                f"| `{fld.name}` | `{_cell(fld.type)}` | `{_cell(fld.default)}` | {_cell(fld.doc)} | {_cell(checks)} |"
            )
        parts.append("")
    return "\n".join(parts)
