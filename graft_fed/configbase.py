"""Loading YAML/dicts into frozen, validated config dataclasses.

Every component config is a frozen dataclass whose fields are documented once, in a
`#:` comment or the class docstring, and checked in `__post_init__`. This module turns a
nested mapping into such a dataclass and refuses unknown keys with a message that names
the key, where it was and what the valid keys are.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml

from graft_fed.errors import ConfigError

T = TypeVar("T")


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, where: str) -> Any:
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed here; give a value or remove the key to use the default")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {type(value).__name__}")
        return from_mapping(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        if origin is tuple and len(args) >= 2 and args[1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        items = [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict,):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads 1e-6 (no dot) as a string; accept it when it parses.
            parsed = None
            if isinstance(value, str):
                try:
                    parsed = float(value)
                except ValueError:
                    pass
            if parsed is None:
                raise ConfigError(f"{where}: expected a number, got {value!r}")
            value = parsed
        if math.isnan(value):  # .nan, or the strings nan / NaN
            raise ConfigError(f"{where}: NaN is not a setting; give a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"unknown key {path!r}{hint}; valid keys here are: {', '.join(sorted(fields))}")
        kwargs[key] = _convert(value, hints[key], path)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from None
    except TypeError as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML would keep the
    last one silently, so `n: 4` ... `n: 8` would run with 8 and nobody would know)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen.setdefault(key, line)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if first is not None:
                where = f"lines {first} and {line}" if first != line else f"line {line}"
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice ({where}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def safe_load(text: str) -> Any:
    """yaml.safe_load, refusing duplicate keys (`_UniqueKeyLoader`)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def utf8_text(raw: bytes, what: str, encoding: str = "utf-8") -> str:
    """`raw` decoded, or a ConfigError saying where in `what` (a file) it is not UTF-8."""
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          "save it as UTF-8") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    text = utf8_text(raw, str(path))
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`--set` arguments (`section.key=value`, the value read as YAML) as `load_config`'s
    dotted overrides. Nothing after the `=` is the empty string, not YAML's null: that is
    what `--set http=''` reaches the program as once a shell has taken its quotes (null is
    `--set key=null`)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set run.steps=20")
        key, value = item.split("=", 1)
        if not value.strip():
            out[key.strip()] = ""
            continue
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value  # not YAML (e.g. listen=[::1]:0): the text as written
    return out


def load_config(cls: type[T], path: str | Path | None, overrides: Mapping[str, Any] | None = None,
                what: str = "config") -> T:
    """Read a YAML file (or nothing: the defaults), apply dotted `overrides`
    (``{"run.steps": 20}``, as `--set run.steps=20` gives), and build `cls`."""
    data: dict[str, Any] = load_yaml(path) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node[leaf] = value
    try:
        return from_mapping(cls, data)
    except ConfigError as exc:
        where = f" in {path}" if path is not None else ""
        raise ConfigError(f"invalid {what}{where}: {exc}") from None


def deep_merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """`a` updated by `b`, merging nested mappings key by key (b wins on leaves)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, YAML-serialisable dict of a config dataclass (tuples become lists)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(cfg)


def require_address(value: str, key: str, port_zero: bool = True) -> None:
    """`value` is HOST:PORT, the port a number in 0-65535 (1-65535 without `port_zero`,
    where 0 would ask the system for any free port) and an IPv6 host in brackets; raises
    ConfigError naming `key` otherwise."""
    host, sep, port = value.rpartition(":")
    require(bool(sep and host), f"{key} must be HOST:PORT, e.g. 127.0.0.1:50551; got {value!r}")
    lowest = 0 if port_zero else 1
    require(port.isascii() and port.isdigit() and lowest <= int(port) <= 65535,
            f"{key}: the port must be a number in {lowest}-65535, got {port!r} in {value!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    require(bracketed or ":" not in host, f"{key}: write an IPv6 host in brackets, e.g. [::1]:PORT; got {value!r}")
    bare = host[1:-1] if bracketed else host
    require(bool(bare) and not any(c.isspace() for c in bare), f"{key}: the host is empty or has spaces in {value!r}")


def require(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond; message says how to fix it."""
    if not cond:
        raise ConfigError(message)
