"""Instruction-data record formats -> chat messages.

- instruction: the reference tutorial's `{"instruction": ..., "output": ...}`
- alpaca: `{"instruction", "input", "output", "system"}` (input and system optional)
- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`
"""

from __future__ import annotations

from typing import Literal

RecordFormat = Literal["instruction", "alpaca", "chat"]
FORMATS: tuple[str, ...] = ("instruction", "alpaca", "chat")
ROLES = ("system", "user", "assistant")


class RecordError(ValueError):
    """One row that cannot be used; the message is the reason stats.json reports for it."""


def detect_format(record: dict) -> RecordFormat:
    if "messages" in record:
        return "chat"
    if "instruction" in record and "output" in record:
        return "alpaca" if ("input" in record or "system" in record) else "instruction"
    keys = ", ".join(sorted(record)) or "none"
    raise RecordError(
        f"unrecognised record (keys: {keys}); expected instruction+output, "
        "instruction+input+output(+system), or messages"
    )


def _text(record: dict, key: str, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RecordError(f"{key!r} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise RecordError(f"{key!r} is empty")
    return value


def _instruction_messages(record: dict, with_extras: bool) -> list[dict]:
    prompt = _text(record, "instruction")
    if with_extras:
        extra = _text(record, "input", required=False)
        prompt = f"{prompt}\n\n{extra}" if extra.strip() else prompt
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(record, "output")}]
    system = _text(record, "system", required=False) if with_extras else ""
    return ([{"role": "system", "content": system}] if system.strip() else []) + messages


def _chat_messages(record: dict) -> list[dict]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise RecordError("'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RecordError(f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': a string}}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "assistant":
        raise RecordError("the last message must be the assistant's (it is what is trained)")
    return out


def to_messages(record: object, fmt: str = "auto") -> tuple[RecordFormat, list[dict]]:
    """The record's format and its messages, ending with the assistant turn to learn."""
    if not isinstance(record, dict):
        raise RecordError(f"a row must be a JSON object, got {type(record).__name__}")
    found = detect_format(record) if fmt == "auto" else fmt
    if fmt != "auto" and fmt not in FORMATS:
        raise RecordError(f"unknown format {fmt!r}; use auto, {', '.join(FORMATS)}")
    if found == "chat":
        if "messages" not in record:
            raise RecordError("format chat needs a 'messages' list")
        return found, _chat_messages(record)
    return found, _instruction_messages(record, with_extras=found == "alpaca")
