"""Typed YAML configs, shared by every entry point that reads one (runs, model CLIs, tests).

Files may extend each other (`extends: base.yaml` or a list), dotted command-line overrides
(`train.lr=3e-4`) go on top, and the merged tree is built into dataclasses: an unknown key, a wrong
type or a bad value is a `ConfigError` naming the dotted key, the file it came from and what was
expected. Value checks live in each dataclass's `__post_init__`, which raises
`ValueError("field: message")`. It lives in model/ because model/ is the lowest package whose entry
points read YAML, and model/ may not import pretrain/.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

COMMAND_LINE = "<command line>"
_FINITE = "a finite number"
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_PARENT = re.compile(r"(\.[^.\[]*|\[\d+\])$|^[^.\[]*$")  # the last `.key` or `[i]` of a dotted key


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 6, 6, 2


def short(value: Any) -> str:
    """`repr(value)` capped at about 80 characters, so that an error message stays one line whatever
    the value (a huge list, a long string)."""
    return _SHORT.repr(value)[:80]


class _StrictLoader(yaml.SafeLoader):
    """The safe loader without aliases (a few hundred bytes of nested aliases expand to gigabytes)
    and without duplicate keys (the second would silently win)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"line {mark.line + 1}: aliases (*name) are not allowed in configs")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.YAMLError(f"line {key_node.start_mark.line + 1}: duplicate key {short(key)}")
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """YAML text as plain data, refusing aliases and duplicate keys (raises yaml.YAMLError)."""
    return yaml.load(text, Loader=_StrictLoader)


# ----------------------------------------------------------------------------- reading YAML


def read_mapping(path: Path) -> dict[str, Any]:
    """One YAML file (no `extends`) as a mapping, or a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _merge(base: dict, extra: dict, sources: dict[str, str] | None, origin: str, prefix: str = "") -> dict:
    """Deep-merge `extra` into a copy of `base`; with `sources`, record `origin` for each key set."""
    merged = dict(base)
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, sources, origin, dotted + ".")
        else:
            merged[key] = value
            if sources is not None:
                _record_sources(value, dotted, sources, origin)
    return merged


def _record_sources(value: Any, dotted: str, sources: dict[str, str], origin: str) -> None:
    """Record `origin` for `dotted` and every key below it, list items (`key[0]`) included."""
    sources[dotted] = origin
    if isinstance(value, dict):
        for key, sub in value.items():
            _record_sources(sub, f"{dotted}.{key}", sources, origin)
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            _record_sources(sub, f"{dotted}[{index}]", sources, origin)


def _load_tree(path: Path, sources: dict[str, str], chain: tuple[Path, ...] = ()) -> dict:
    """Load one file on top of the files it extends (in order), recording each key's file."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"{path}: 'extends' forms a cycle: {cycle}")
    data = read_mapping(path)
    parents = data.pop("extends", [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: extends: expected a file name or a list of file names, got {short(parents)}")
    tree: dict = {}
    for parent in parents:
        tree = _merge(tree, _load_tree(path.parent / parent, sources, (*chain, path)), None, "")
    return _merge(tree, data, sources, str(path))


def _apply_override(tree: dict, item: str, sources: dict[str, str]) -> None:
    if "=" not in item:
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: expected key=value, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: malformed key {key!r}")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"{COMMAND_LINE}: override {key}: cannot parse value {short(raw)}: {err}") from err
    node = tree
    for depth, part in enumerate(parts[:-1]):
        section = ".".join(parts[: depth + 1])
        if part not in node:  # a section the command line creates: a mistake in it is the command line's
            sources.setdefault(section, COMMAND_LINE)
        child = node.setdefault(part, {})
        if isinstance(child, list):
            raise ConfigError(
                f"{COMMAND_LINE}: override {key}: {section} is a list, not a section; set the whole list, "
                f"e.g. {section}='{_list_example(child)}'"
            )
        if not isinstance(child, dict):
            raise ConfigError(f"{COMMAND_LINE}: override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value
    _record_sources(value, ".".join(parts), sources, COMMAND_LINE)


def _list_example(items: list[Any]) -> str:
    """A list override in YAML flow style, built from the list's first item (the shape its items
    take), for the message that shows how to set a list on the command line."""
    if not items:
        return "[a, b]"
    first = yaml.safe_dump(items[0], default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
    return f"[{first}]" if len(first) <= 100 else "[...]"


def to_overrides(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """The inverse of the override parser: `{a: {b: 1}}` under `prefix` x as `["x.a.b=1"]` (values
    in YAML flow style), so that applying the overrides to an empty tree gives `tree` back."""
    items = []
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            items.extend(to_overrides(value, dotted))
        else:
            text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            items.append(f"{dotted}={text}")
    return items


def dump_yaml(tree: dict[str, Any]) -> str:
    """Plain data as block-style YAML in insertion order: what `read_mapping` reads back."""
    return yaml.safe_dump(tree, sort_keys=False)


# ----------------------------------------------------------------------------- typed building


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


class _Mismatch(Exception):
    def __init__(self, key: str, expected: str, got: Any):
        super().__init__(key)
        self.key, self.expected, self.got = key, expected, got


def _convert(tp: Any, value: Any, key: str, sources: dict[str, str]) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch(key, _type_name(tp), value)
        return _build(tp, value, key, sources)
    if origin is Literal:
        if value not in get_args(tp):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        inner = None  # an option whose shape fits but whose field or value does not: name that problem
        for option in get_args(tp):
            if option is type(None):
                continue
            try:
                return _convert(option, value, key, sources)
            except _Mismatch as mismatch:
                fits = mismatch.key != key or mismatch.expected == _FINITE
                inner = inner or (mismatch if fits else None)
        raise inner or _Mismatch(key, _type_name(tp), value)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(key, _type_name(tp), value)
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, v, f"{key}[{i}]", sources) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(key, _type_name(tp), value)
        _, item_tp = get_args(tp)
        return {str(k): _convert(item_tp, v, f"{key}.{k}", sources) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    if tp is float:
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch(key, _type_name(tp), value)
        if not math.isfinite(value):
            raise _Mismatch(key, _FINITE, value)  # NaN or infinity would train nothing
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {key}")


def _source_of(key: str, sources: dict[str, str]) -> str:
    """The file (or the command line) that set `key` or the nearest section or list above it."""
    probe = key
    while probe:
        if probe in sources:
            return sources[probe]
        probe = _PARENT.sub("", probe)
    return "<defaults>"


def yaml_key(field: dataclasses.Field) -> str:
    """The key a field has in YAML: its name, or `metadata["yaml"]` where the name cannot be a Python
    identifier (`init.from` is the field `from_`)."""
    return field.metadata.get("yaml", field.name)


def to_plain(config: Any) -> Any:
    """A config dataclass as plain nested data with its YAML keys; `build_config` reads it back."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {yaml_key(f): to_plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return type(config)(to_plain(v) for v in config)
    if isinstance(config, dict):
        return {k: to_plain(v) for k, v in config.items()}
    return config


def _build(cls: type, tree: dict, prefix: str, sources: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls) if f.init}
    for key in tree:
        if key not in fields:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"{_source_of(dotted, sources)}: {dotted}: unknown key; "
                f"{cls.__name__} {'section ' + prefix + ' ' if prefix else ''}accepts: {known}"
            )
    kwargs = {}
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else key
        name = fields[key].name
        kwargs[name] = _convert(hints[name], value, dotted, sources)
    try:
        return cls(**kwargs)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        message = str(err)
        field_name, sep, detail = message.partition(": ")
        if sep and field_name in fields:
            dotted = f"{prefix}.{field_name}" if prefix else field_name
            raise ConfigError(f"{_source_of(dotted, sources)}: {dotted}: {detail}") from None
        where = prefix or "<top level>"
        raise ConfigError(f"{_source_of(prefix, sources)}: {where}: {message}") from None


def read_tree(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict, dict[str, str]]:
    """The merged tree of `path` and the files it extends, with `overrides` applied, and the file
    (or the command line) each dotted key came from."""
    sources: dict[str, str] = {}
    tree = _load_tree(Path(path), sources)
    apply_overrides(tree, overrides, sources)
    return tree, sources


def apply_overrides(tree: dict, overrides: list[str] | tuple[str, ...], sources: dict[str, str]) -> None:
    """Apply dotted `key=value` overrides to `tree` in place, recording the command line as their source."""
    for item in overrides:
        _apply_override(tree, item, sources)


def build_config(cls: type, tree: dict, sources: dict[str, str] | None = None, prefix: str = "") -> Any:
    """Validate a plain nested dict into dataclass `cls` (whose keys sit under `prefix` in the file)."""
    sources = sources if sources is not None else {}
    try:
        return _build(cls, tree, prefix, sources)
    except _Mismatch as err:
        raise ConfigError(
            f"{_source_of(err.key, sources)}: {err.key}: expected {err.expected}, "
            f"got {short(err.got)} ({type(err.got).__name__})"
        ) from None


def check_range(
    key: str, value: float, low: float | None = None, high: float | None = None,
    *, low_open: bool = False, high_open: bool = False, note: str = "",
) -> None:
    """The one range check of every config `__post_init__`: `value` must lie between `low` and `high`
    (either may be None; `*_open` excludes that end). Raises `ValueError("key: ...")`, which the typed
    builder turns into a ConfigError naming the dotted key and the file that set it."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high):
        return
    if high is None:
        wanted = f"must be {'>' if low_open else '>='} {low}"
    elif low is None:
        wanted = f"must be {'<' if high_open else '<='} {high}"
    else:
        wanted = f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    raise ValueError(f"{key}: {wanted}{note}, got {short(value)}")
