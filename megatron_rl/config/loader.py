"""YAML recipes → `RecipeConfig`: `defaults:` inheritance, dotted overrides, strict typing.

A recipe is a minimal delta: `defaults:` names one or more base files (relative to the recipe),
merged in order, then the recipe's own keys on top (mappings merge key by key, everything else
replaces), then `key.path=value` overrides from the command line. Every key remembers where its
final value came from, so an error can name the file and line.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .errors import ConfigError, Problem
from .schema import RecipeConfig

Positions = dict[tuple[str, ...], str]


def _node_to_python(node: yaml.Node, file: str, path: tuple[str, ...], pos: Positions) -> Any:
    """Convert a composed YAML node, recording 'file:line' for every mapping key."""
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(yaml.safe_load(yaml.serialize(key_node)))
            sub = path + (key,)
            if key in out:      # YAML would keep the last one silently
                raise ConfigError([Problem(f"{file}:{key_node.start_mark.line + 1}", ".".join(sub),
                                           f"duplicate key (first set at {pos[sub]})")])
            pos[sub] = f"{file}:{key_node.start_mark.line + 1}"
            out[key] = _node_to_python(value_node, file, sub, pos)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_node_to_python(v, file, path, pos) for v in node.value]
    return yaml.safe_load(yaml.serialize(node))


def _read_yaml(path: Path, pos: Positions) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError([Problem("", "", f"recipe file not found: {path}")])
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError([Problem(f"{path}:{line}", "", f"not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                                                          "save the recipe as UTF-8")]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError([Problem(where, "", f"invalid YAML: {getattr(exc, 'problem', exc)}")]) from None
    if node is None:
        return {}
    data = _node_to_python(node, str(path), (), pos)
    if not isinstance(data, dict):
        raise ConfigError([Problem(f"{path}:1", "", "a recipe must be a mapping of sections")])
    return data


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_layers(path: Path, pos: Positions, chain: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in chain + (path,))
        raise ConfigError([Problem(str(path), "defaults", f"inheritance cycle: {cycle}")])
    own_pos: Positions = {}
    data = _read_yaml(path, own_pos)
    defaults = data.pop("defaults", [])
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        where = own_pos.get(("defaults",), str(path))
        raise ConfigError([Problem(where, "defaults", "must be a file name or a list of file names")])
    merged: dict[str, Any] = {}
    for name in defaults:
        base = path.parent / name
        if not base.is_file():
            where = own_pos.get(("defaults",), str(path))
            raise ConfigError([Problem(where, "defaults", f"base recipe not found: {base}")])
        merged = _merge(merged, _load_layers(base, pos, chain + (path,)))
    own_pos.pop(("defaults",), None)
    pos.update(own_pos)
    return _merge(merged, data)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """'trainer.lr=1e-6' → (('trainer', 'lr'), 1e-06); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError([Problem("", "", f"override {text!r} is not of the form key.path=value")])
    if not raw.strip():
        raise ConfigError([Problem("", "", f"override {text!r} has no value (write {key.strip()}=null for null)")])
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return tuple(key.strip().split(".")), value


def _apply_override(data: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = data
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


def load_raw(path: str | Path, overrides: list[str] | None = None) -> tuple[dict[str, Any], Positions]:
    """The merged recipe as plain data plus the source of every key."""
    pos: Positions = {}
    data = _load_layers(Path(path), pos, ())
    for i, text in enumerate(overrides or [], start=1):
        keys, value = parse_override(text)
        label = f"override #{i} ({text})"
        node: Any = data
        for j, key in enumerate(keys[:-1], start=1):      # values the override replaces are its own
            node = node.get(key) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                pos[keys[:j]] = label
        _apply_override(data, keys, value)
        pos[keys] = label
    return data, pos


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> RecipeConfig:
    """Load, merge, override and type-check a recipe. Raises ConfigError listing every problem."""
    data, pos = load_raw(path, overrides)
    data.setdefault("name", Path(path).stem)
    problems: list[Problem] = []
    cfg = _build(RecipeConfig, data, (), pos, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------------------- typed building
def _where(pos: Positions, path: tuple[str, ...]) -> str:
    while path:
        if path in pos:
            return pos[path]
        path = path[:-1]
    return ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return str(tp).replace("typing.", "")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


class _Invalid(Exception):
    pass


def _convert(tp: Any, value: Any, path: tuple[str, ...], pos: Positions, problems: list[Problem]) -> Any:
    """Check `value` against the annotation `tp`; raise _Invalid when it does not fit."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Invalid
        return _build(tp, value, path, pos, problems)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(arg, value, path, pos, problems)
            except _Invalid:
                continue
        raise _Invalid
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            return "on" if value else "off"     # YAML 1.1 reads an unquoted on/off as a bool
        if value in choices and not isinstance(value, bool):
            return value
        raise _Invalid
    if origin is list:
        if not isinstance(value, list):
            raise _Invalid
        (item,) = typing.get_args(tp)
        return [_convert(item, v, path, pos, problems) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Invalid
        _, item = typing.get_args(tp)
        out = {}
        for k, v in value.items():     # a bad entry is reported where it was set, not at its section
            try:
                out[str(k)] = _convert(item, v, path + (str(k),), pos, problems)
            except _Invalid:
                sub = path + (str(k),)
                problems.append(Problem(_where(pos, sub), ".".join(sub),
                                        f"got {v!r} ({type(v).__name__}); expected {_type_name(item)}"))
        return out
    return _convert_scalar(tp, value)


def _convert_scalar(tp: Any, value: Any) -> Any:
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _Invalid
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Invalid
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Invalid
    if tp is float:
        # YAML 1.1 reads '1e-6' (no dot) as a string; accept what float() accepts.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Invalid from None
        raise _Invalid
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Invalid
    raise TypeError(f"unsupported schema type {tp!r}")


def _check_range(f: dataclasses.Field, value: Any) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    checks = (("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b),
              ("le", "<=", lambda a, b: a <= b), ("lt", "<", lambda a, b: a < b))
    for name, _sym, ok in checks:
        bound = f.metadata.get(name)
        if bound is not None and not ok(value, bound):
            allowed = " and ".join(f"{s} {f.metadata[n]}" for n, s, _ in checks if n in f.metadata)
            return f"value {value!r} is out of range; allowed: {allowed}"
    return None


def _check_implemented(f: dataclasses.Field, value: Any) -> str | None:
    reason = f.metadata.get("not_implemented")
    if reason is None or value == f.default:
        return None
    return f"value {json.dumps(value)} is not supported yet: {reason}; allowed: {json.dumps(f.default)}"


def _build(cls: type, data: dict[str, Any], path: tuple[str, ...], pos: Positions,
           problems: list[Problem]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = path + (str(key),)
        if key not in fields:
            problems.append(Problem(_where(pos, sub), ".".join(sub), _unknown_key_message(str(key), fields)))
            continue
        try:
            converted = _convert(hints[key], value, sub, pos, problems)
        except _Invalid:
            problems.append(Problem(_where(pos, sub), ".".join(sub),
                                    f"got {value!r} ({type(value).__name__}); expected {_type_name(hints[key])}"))
            continue
        if fields[key].metadata.get("path") and isinstance(converted, str):
            converted = _absolute_path(converted, pos.get(sub, ""))
        message = _check_range(fields[key], converted) or _check_implemented(fields[key], converted)
        if isinstance(converted, float) and not math.isfinite(converted):
            message = f"value {converted!r} is not a finite number"
        if message:
            problems.append(Problem(_where(pos, sub), ".".join(sub), message))
            continue
        kwargs[key] = converted
    return cls(**kwargs)


def _absolute_path(value: str, where: str) -> str:
    """Relative to the recipe file that set it, or to the working directory for overrides."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    file = where.rsplit(":", 1)[0] if where and not where.startswith("override") else ""
    base = Path(file).parent if file else Path.cwd()
    return os.path.normpath(base / p)


def _unknown_key_message(key: str, fields: dict[str, dataclasses.Field]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key; {hint}allowed: {', '.join(fields)}"


# ---------------------------------------------------------------------------- output
def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)


def write_resolved(cfg: Any, run_dir: str | Path, name: str = "recipe.resolved.yaml") -> Path:
    """Write the fully resolved recipe into the run dir (atomically: tmp file + rename)."""
    out = Path(run_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    text = dump_yaml(cfg)
    try:
        tmp.write_text(text, encoding="utf-8")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write {out} ({len(text.encode())} bytes): {exc.strerror}") from exc
    tmp.replace(out)
    return out
