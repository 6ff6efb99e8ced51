"""Typed configuration: field checks, and dataclasses from YAML with errors that say where.

Component configs live next to the code they configure (one ``@dataclass(kw_only=True)`` each) and
check their values in ``__post_init__`` with :func:`check_range` / :func:`check_choice`, raising
:class:`ConfigFieldError` with the field's name. :func:`load_dataclass` reads a YAML file into a
(nested) config dataclass, applies ``key.sub=value`` overrides from the command line, and reports
every problem with the file, the line and the dotted field::

    examples/bad.yaml:4: algorithm.eps_high: must be >= eps_low (0.2), got 0.1

Recipes are read with a strict loader (:func:`load_yaml_text`): a duplicate key, an alias that
expands past a bound (the "billion laughs"), nesting past a bound, or text that is not UTF-8 is
refused with the file and line; a UTF-8 byte-order mark is accepted.

The whole recipe (``RunConfig``) is composed in :mod:`megatron_rl.orchestration.recipe`. Layer 1:
imports only :mod:`megatron_rl.errors`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import yaml

from megatron_rl.errors import UsageError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# Values read from YAML (and from ``key=value`` overrides) are ``Any``: their shape is what the
# loader checks against each field's type hint, so it is not known before that check.
YamlValue = Any
C = TypeVar("C", bound="DataclassInstance")  # the config dataclass being built

__all__ = [
    "ConfigError",
    "ConfigFieldError",
    "check_choice",
    "check_range",
    "config_from_dict",
    "config_to_dict",
    "load_dataclass",
    "load_yaml_text",
    "parse_overrides",
    "read_yaml_file",
]


class ConfigError(UsageError):
    """A configuration problem, with the place it comes from in the message."""


class ConfigFieldError(UsageError):
    """Raised by a config's ``__post_init__``; the loader adds the file, line and section."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise :class:`ConfigFieldError` unless ``value`` lies in the given (half-)open range.

    NaN and +-inf are refused whatever the range: every comparison with NaN is False, so NaN
    would pass any bound, and an infinite learning rate or clip is a typo (YAML's ``.inf``), not
    a setting. A field meaning "no limit" says so with its own value (0 or None), not with inf.
    """
    if not isinstance(value, int) and not math.isfinite(value):  # ints are always finite
        raise ConfigFieldError(name, f"must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "inf" if high is None else f"{high}{')' if high_open else ']'}"
        if low is None:
            lo = "(-inf"
        if high is None:
            hi = "inf)"
        raise ConfigFieldError(name, f"must be in {lo}, {hi}, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ConfigFieldError(name, f"must be one of {list(choices)}, got {value!r}")


#: Bounds of the strict YAML loader. A recipe is a few dozen keys a few levels deep; these bounds
#: are far above that and far below what makes a loader slow: 10 levels of 10 aliases each
#: expand to 10^10 nodes (the "billion laughs"), which a plain safe_load builds until memory
#: runs out. The node budget counts every node as built, aliases expanded.
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 100_000
#: Largest integer a recipe may hold: beyond int64 no field means anything, and a 10^5-digit
#: integer only makes every later comparison slow.
MAX_YAML_INT = 2**63 - 1


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and integers past int64; :func:`_check_shape`
    bounds depth, expanded size and alias cycles before anything is constructed."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source

    def _where(self, node: yaml.Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}"

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        value = super().construct_yaml_int(node)
        if abs(value) > MAX_YAML_INT:
            raise ConfigError(f"{self._where(node)}: integer {str(node.value)[:20]}... is larger than 2^63-1")
        return value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[YamlValue, YamlValue]:
        first_line: dict[YamlValue, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: the keys set next to it override the base's, on purpose
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(f"{self._where(key_node)}: a key must be a plain value")
            key = self.construct_object(key_node, deep=True)
            if key in first_line:
                raise ConfigError(
                    f"{self._where(key_node)}: duplicate key {key!r} (first set at line "
                    f"{first_line[key]}); set each key once"
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _children(n: yaml.Node) -> list[yaml.Node]:
    if isinstance(n, yaml.MappingNode):
        return [x for pair in n.value for x in pair]
    if isinstance(n, yaml.SequenceNode):
        return list(n.value)
    return []


def _check_shape(root: yaml.Node, source: str) -> None:
    """Refuse a node graph that has an alias cycle, is nested deeper than MAX_YAML_DEPTH, or
    expands (aliases written out) to more than MAX_YAML_NODES nodes. An alias is the very node
    object it names, so a post-order walk with memoised (depth, size) per node costs one visit
    per distinct node however large the expansion -- which is what a plain loader would build."""
    shape: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        if done:
            on_path.discard(id(n))
            kids = [shape[id(k)] for k in _children(n)]
            depth = 1 + max((d for d, _ in kids), default=0)
            size = 1 + sum(z for _, z in kids)
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(
                    f"{source}:{n.start_mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels"
                )
            if size > MAX_YAML_NODES:
                raise ConfigError(
                    f"{source}:{n.start_mark.line + 1}: aliases expand this to more than "
                    f"{MAX_YAML_NODES} values; write the values out"
                )
            shape[id(n)] = (depth, size)
            continue
        if id(n) in shape:
            continue
        if id(n) in on_path:
            raise ConfigError(
                f"{source}:{n.start_mark.line + 1}: an alias refers to the value that contains it"
            )
        on_path.add(id(n))
        stack.append((n, True))
        stack.extend((k, False) for k in _children(n) if id(k) not in shape)


def load_yaml_text(text: str, source: str) -> tuple[YamlValue, dict[str, int]]:
    """Parse YAML strictly (see the module docstring); also return the 1-based line of every dotted
    key path. Raises :class:`ConfigError` naming ``source`` and the line."""
    text = text.removeprefix("\ufeff")  # a byte-order mark, as some editors write it
    try:
        loader = _StrictLoader(text, source)  # its reader refuses control characters right here
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_shape(node, source)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:  # one line: the place, the problem, and what it was inside
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(
            f"{where}: invalid YAML: {problem}" + (f" ({context})" if context else "")
        ) from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply (or an alias refers to itself)") from None
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, prefix: str) -> None:  # bounded: _check_shape passed
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = f"{prefix}{k.value}"
                lines[key] = k.start_mark.line + 1
                walk(v, key + ".")
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[f"{prefix}{i}"] = v.start_mark.line + 1
                walk(v, f"{prefix}{i}.")

    if node is not None:
        walk(node, "")
    return data, lines


def read_yaml_file(path: str | Path, what: str = "recipe") -> tuple[YamlValue, dict[str, int]]:
    """Read and strictly parse a YAML file (:func:`load_yaml_text`); a missing or unreadable file,
    or one that is not UTF-8, is a :class:`ConfigError` naming it."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{source}: cannot read {what}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{source}:{line}: not UTF-8 text (byte {e.start + 1}); save the {what} as UTF-8"
        ) from None
    return load_yaml_text(text, source)


def _where(source: str, lines: dict[str, int], path: str) -> str:
    # Report the deepest known ancestor's line when the field itself was not in the file.
    probe = path
    while probe:
        if probe in lines:
            return f"{source}:{lines[probe]}"
        probe = probe.rpartition(".")[0]
    return source


def _coerce(value: YamlValue, hint: object, name: str) -> YamlValue:
    """Check/convert a YAML scalar against a field's type hint (int, float, bool, str, Literal,
    Optional, list/dict); raises ConfigFieldError naming the field."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, name)
            except ConfigFieldError:
                pass
        raise ConfigFieldError(name, f"expected {hint}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigFieldError(name, f"must be one of {list(choices)}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigFieldError(name, f"expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigFieldError(name, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigFieldError(name, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigFieldError(name, f"expected a string, got {value!r}")
        return value
    if origin in (list, tuple) and not isinstance(value, (list, tuple)):
        raise ConfigFieldError(name, f"expected a list, got {value!r}")
    if origin is dict and not isinstance(value, dict):
        raise ConfigFieldError(name, f"expected a mapping, got {value!r}")
    return value


def config_from_dict(
    cls: type[C],
    data: dict[str, YamlValue] | None,
    *,
    source: str = "<config>",
    lines: dict[str, int] | None = None,
    prefix: str = "",
) -> C:
    """Build dataclass ``cls`` from a nested dict, checking every key and value."""
    lines = lines or {}
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_where(source, lines, prefix.rstrip('.'))}: {prefix.rstrip('.') or 'config'}: "
            f"expected a mapping, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(
                f"{_where(source, lines, path)}: unknown field '{path}' "
                f"(known in {cls.__name__}: {', '.join(sorted(known))})"
            )
        hint = hints[key]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):  # `algorithm:` with nothing under it reads as null
                raise ConfigError(
                    f"{_where(source, lines, path)}: {path}: a section must be a mapping of its "
                    f"fields, got {'nothing (null)' if value is None else repr(value)}; remove the "
                    "line to keep the defaults"
                )
            kwargs[key] = config_from_dict(hint, value, source=source, lines=lines, prefix=path + ".")
            continue
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            if not isinstance(value, list):
                raise ConfigError(f"{_where(source, lines, path)}: {path}: expected a list, got {value!r}")
            kwargs[key] = [
                config_from_dict(item, v, source=source, lines=lines, prefix=f"{path}.{i}.")
                for i, v in enumerate(value)
            ]
            continue
        try:
            kwargs[key] = _coerce(value, hint, key)
        except ConfigFieldError as e:
            raise ConfigError(f"{_where(source, lines, path)}: {path}: {e.message}") from None
    try:
        return cls(**kwargs)
    except ConfigFieldError as e:
        path = f"{prefix}{e.field}"
        raise ConfigError(f"{_where(source, lines, path)}: {path}: {e.message}") from None


def parse_overrides(overrides: list[str]) -> dict[str, YamlValue]:
    """``["a.b=3", "c=x"]`` -> ``{"a": {"b": 3}, "c": "x"}``; values are parsed as YAML scalars."""
    out: dict[str, YamlValue] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY.PATH=VALUE")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is set to a value and to a section")
        node[leaf] = load_yaml_text(raw, f"override {item!r}")[0] if raw else ""
    return out


def _merge(base: dict[str, YamlValue], extra: dict[str, YamlValue]) -> dict[str, YamlValue]:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_dataclass(
    cls: type[C],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    check: Callable[[C], None] | None = None,
) -> C:
    """Read a YAML file into dataclass ``cls`` (only defaults when ``path`` is None) and apply
    dotted overrides; raises :class:`ConfigError` naming the file, line and field. ``check(cfg)``
    may raise :class:`ConfigFieldError` with a dotted field (e.g. ``data.train``) for checks made
    on the whole config after it is built; it is reported with that field's line too."""
    data: dict[str, YamlValue] = {}
    lines: dict[str, int] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data, lines = read_yaml_file(path)
        data = data or {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}:1: a recipe must be a mapping of sections, got {type(data).__name__}"
            )
    if overrides:
        over = parse_overrides(overrides)
        data = _merge(data, over)
        # Lines of overridden keys point at the command line, not at the file.
        for k in list(lines):
            if any(k == o or k.startswith(o + ".") for o in _flat_keys(over)):
                del lines[k]
        source = f"{source} (with overrides {' '.join(overrides)})"
    cfg = config_from_dict(cls, data, source=source, lines=lines)
    if check is not None:
        try:
            check(cfg)
        except ConfigFieldError as e:
            raise ConfigError(f"{_where(source, lines, e.field)}: {e.field}: {e.message}") from None
    return cfg


def _flat_keys(d: dict[str, YamlValue], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for k, v in d.items():
        keys.extend(_flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])
    return keys


def config_to_dict(cfg: DataclassInstance) -> dict[str, YamlValue]:
    """Plain nested dict of a config (for snapshots and ``megatron-rl config``)."""
    return dataclasses.asdict(cfg)
