"""Dotted-key access to nested config dicts (`engine.page_size`), alias moves and `key=value` overrides."""

from __future__ import annotations

from typing import Any

import yaml

from mlc.errors import ConfigError


def set_path(data: dict, dotted: str, value: Any) -> None:
    head, _, rest = dotted.partition(".")
    if not rest:
        data[head] = value
        return
    if not isinstance(data.get(head), dict):
        data[head] = {} if data.get(head) is None else data[head]
    if isinstance(data[head], dict):
        set_path(data[head], rest, value)


def get_path(data: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def pop_path(data: dict, dotted: str) -> tuple[bool, Any]:
    """Remove and return a dotted key; parents left empty are removed too."""
    head, _, rest = dotted.partition(".")
    if head not in data:
        return False, None
    if not rest:
        return True, data.pop(head)
    inner = data[head]
    if not isinstance(inner, dict):
        return False, None
    found, value = pop_path(inner, rest)
    if found and not inner:
        data.pop(head)
    return found, value


def move_alias(data: dict, src: str, dst: str, origin: dict[str, str]) -> None:
    """Move an alias key to our key, recording where it came from; both given with different values is an error."""
    found, value = pop_path(data, src)
    if not found:
        return
    present, current = get_path(data, dst)
    if present and current != value:
        raise ValueError(f"{src} ({value!r}) and {dst} ({current!r}) disagree; keep one of them")
    set_path(data, dst, value)
    origin[dst] = src


def parse_assignments(items: list[str] | None, what: str, example: str) -> dict[str, Any]:
    """`key.sub=value` strings -> {dotted key: value}; values read as YAML (1e-4, true, [a, b]); empty is null."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what} {item!r} is not key=value; write e.g. {example}")
        try:
            out[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"{what} {item!r}: the value is not valid YAML ({e})") from None
    return out
