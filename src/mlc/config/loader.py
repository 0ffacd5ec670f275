"""The one config loader: a YAML file, its aliases and command-line overrides, validated into a pydantic schema.

Every command reads its config here (serve, the engine commands, train, `config check`, plan, doctor). Every
problem is reported as `file: key: problem (allowed: ...)`, all of them at once, as one ConfigError.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mlc.config.cluster_config import ClusterConfig
from mlc.config.dotted import get_path, parse_assignments, set_path
from mlc.config.serve_config import ServeConfig
from mlc.config.train_config import TrainConfig
from mlc.errors import ConfigError

T = TypeVar("T", bound=BaseModel)
COMMAND_LINE = "command line"
_PROBE = "\0mlc-override-probe\0"  # a value no config holds, to see where an override key lands


def read_yaml(path: str | Path) -> dict:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file; write one with `mlc-cli config init serve|lora|cluster`")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1} col {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{path}: {where}YAML syntax error: {e.problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not readable as YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not a {type(data).__name__}")
    return data


def load_config(
    path: str | Path | None,
    schema: type[T],
    overrides: dict[str, Any] | None = None,
    assignments: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> T:
    """The schema built from `path` (None -> defaults), then `overrides` (flag values by dotted key, None: flag not
    given), then `assignments` (parsed `key=value` strings, where `key=null` sets null). `notes` gets one line per
    key or value that was translated from another tool's spelling (`file: use_paged_attn -> paged_attention`)."""
    data = read_yaml(path) if path is not None else {}
    label = str(path) if path is not None else "<defaults>"
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    return validate_config(data, schema, label, {**given, **(assignments or {})}, notes)


def _no_aliases(data: dict, notes: list[str] | None = None) -> tuple[dict, dict[str, str]]:
    return data, {}


def validate_config(raw: dict, schema: type[T], label: str = "<config>", overrides: dict[str, Any] | None = None,
                    notes: list[str] | None = None) -> T:
    """`raw` (aliases allowed) as a `schema`, with `overrides` (dotted keys, aliases allowed) set over its values."""
    normalize = getattr(schema, "normalize_aliases", None) or _no_aliases
    overrides = overrides or {}
    ours = {key: our_key(normalize, key) for key in overrides}
    data, origin = copy.deepcopy(raw), {}
    for key in [k for k, o in ours.items() if o is None]:  # reshaped by the aliases (beta1): merged with the file's
        set_path(data, key, overrides[key])
    value_notes: list[str] = []
    try:
        data, origin = normalize(data, value_notes)
        translated = [f"{theirs} -> {ours_}" for ours_, theirs in origin.items()]
        for key, dotted in ours.items():
            if dotted is not None:
                set_path(data, dotted, overrides[key])
            origin[dotted or key] = COMMAND_LINE
        config = schema(**data)
        if notes is not None:
            notes.extend(f"{label}: {line}" for line in dict.fromkeys([*translated, *value_notes]))
        return config
    except ValidationError as e:
        raise ConfigError(format_validation_error(label, e, schema, origin, data)) from None
    except ValueError as e:  # an alias and our key that disagree
        raise ConfigError(f"{label}: {e}") from None


def our_key(normalize, key: str) -> str | None:
    """The dotted key `key` is read as (`learning_rate` -> `optimizer.lr`), or None when the aliases reshape it."""
    probe: dict = {}
    set_path(probe, key, _PROBE)
    try:
        return _path_to(normalize(probe, [])[0], _PROBE)
    except ValueError:
        return None


def _path_to(data: dict, leaf: Any, prefix: str = "") -> str | None:
    for key, value in data.items():
        if isinstance(value, str) and value == leaf:
            return prefix + str(key)
        found = _path_to(value, leaf, f"{prefix}{key}.") if isinstance(value, dict) else None
        if found:
            return found
    return None


def format_validation_error(label: str, err: ValidationError, schema: type[BaseModel], origin=None, data=None) -> str:
    lines = [_format_one(label, e, schema, origin or {}, data or {}) for e in err.errors()]
    return "\n".join(dict.fromkeys(lines))


def _format_one(label: str, e: Mapping[str, Any], schema: type[BaseModel], origin: dict[str, str], data: dict) -> str:
    loc = [str(p) for p in e["loc"]]
    key = ".".join(loc) or "(top level)"
    shown = _shown_key(key, origin)
    field_info, parent = _field_at(schema, loc)
    if e["type"] == "extra_forbidden":
        keys = sorted(parent.model_fields) if parent is not None else []
        hint = difflib.get_close_matches(loc[-1], keys, n=1)
        problem = "unknown key" + (f"; did you mean {'.'.join(loc[:-1] + hint)}?" if hint else "")
        return f"{label}: {shown}: {problem} (allowed: {', '.join(keys)})"
    problem = e["msg"].removeprefix("Value error, ")
    found, value = get_path(data, key) if loc else (False, None)
    if found and e["type"] != "missing" and not isinstance(value, (dict, list)):
        problem += f", got {value!r}"
    allowed = _allowed(field_info, e)
    return f"{label}: {shown}: {problem}" + (f" (allowed: {allowed})" if allowed else "")


def _shown_key(key: str, origin: dict[str, str]) -> str:
    for ours, theirs in sorted(origin.items(), key=lambda kv: -len(kv[0])):
        if key == ours or key.startswith(ours + "."):
            if theirs == COMMAND_LINE:
                return f"{key} (from the command line)"
            return f"{theirs}{key[len(ours):]} (read as {key})"
    return key


def _unwrap(annotation) -> list:
    """The member types of Optional/Union annotations."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _model_in(annotation) -> type[BaseModel] | None:
    for a in _unwrap(annotation):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _field_at(schema: type[BaseModel], loc: list[str]):
    """(FieldInfo of the last key or None, the model that holds the last key or None) for an error location."""
    model: type[BaseModel] | None = schema
    info = None
    for i, part in enumerate(loc):
        holder = model
        if model is not None and part in model.model_fields:
            info = model.model_fields[part]
            model = _model_in(info.annotation)
            if model is None and i + 1 < len(loc):
                args = [a for t in _unwrap(info.annotation) for a in typing.get_args(t)]  # dict[str, X] -> X
                model = _model_in(args[-1]) if args else None
                if model is not None:
                    loc = loc[: i + 1] + loc[i + 2 :]  # skip the dict key / list index
            continue
        return (None, holder) if i == len(loc) - 1 else (None, None)
    return info, holder if loc else schema


def _allowed(info, e: Mapping[str, Any]) -> str:
    if e["type"] == "literal_error":
        return ", ".join(str(v) for v in e.get("ctx", {}).get("expected", "").replace("'", "").split(" or "))
    if info is None:
        return ""
    literals = [v for a in _unwrap(info.annotation) if typing.get_origin(a) is typing.Literal
                for v in typing.get_args(a)]
    if literals:
        return ", ".join(str(v) for v in literals)
    bounds = []
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "at least")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{sym} {getattr(m, attr)}" + (" item(s)" if attr == "min_length" else ""))
    if bounds:
        return " and ".join(bounds)
    if e["type"].startswith("bool"):
        return "true, false"
    return ""


CONFIG_KINDS = ("serve", "lora", "cluster")
SCHEMAS: dict[str, type[BaseModel]] = {"serve": ServeConfig, "lora": TrainConfig, "train": TrainConfig,
                                       "cluster": ClusterConfig}


def schema_for(kind: str) -> type[BaseModel]:
    if kind not in SCHEMAS:
        raise ConfigError(f"unknown config kind {kind!r} (allowed: {', '.join(CONFIG_KINDS)})")
    return SCHEMAS[kind]


def detect_kind(data: dict) -> str:
    """Which schema a config file is for, from its top-level keys."""
    if "nodes" in data or "image" in data:
        return "cluster"
    if {"lora", "optimizer", "data", "lr_schedule", "lora_config", "parallel_config", "model_name_or_path",
            "finetuning_type", "cutoff_len", "lora_rank", "lora_target"} & set(data):
        return "lora"
    return "serve"


def load_any(
    path: str | Path, kind: str | None = None, assignments: dict[str, Any] | None = None
) -> tuple[str, BaseModel]:
    """(kind, config) for a serve, lora or cluster file; the kind is guessed from its keys unless given."""
    kind = kind or detect_kind(read_yaml(path))
    return kind, load_config(path, schema_for(kind), assignments=assignments)


def load_train_config(path: str | Path | None, overrides: list[str] | None = None,
                      notes: list[str] | None = None) -> TrainConfig:
    """`mlc-cli train`: the file (or the defaults) with `key=value` overrides on top (`key=null` sets null)."""
    return load_config(path, TrainConfig, assignments=parse_overrides(overrides), notes=notes)


def validate_train_config(raw: dict[str, Any], label: str = "<config>") -> TrainConfig:
    return validate_config(raw, TrainConfig, label)


def parse_set_options(items: list[str] | None) -> dict[str, Any]:
    """`--set key.sub=value` strings -> {dotted key: value}, values read as YAML (1e-4, true, [a, b])."""
    return parse_assignments(items, "--set", "--set engine.page_size=32")


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """`mlc-cli train`'s `key.sub=value` arguments -> {dotted key: value}, values read as YAML."""
    return parse_assignments(items, "override", "optimizer.lr=1e-4 or max_steps=20")
