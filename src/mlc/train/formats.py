"""Instruction-data record formats -> chat messages.

- instruction: the reference tutorial's `{"instruction": ..., "output": ...}`
- alpaca: `{"instruction", "input", "output", "system"}` (input and system optional)
- chat: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}`
- sharegpt: LLaMA-Factory's `{"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation",
  "value": ...}, ...], "system": ..., "tools": ...}` (system and tools optional); human -> user, gpt and
  function_call -> assistant (the call's JSON text is what is trained), observation -> tool.
"""

from __future__ import annotations

from typing import Literal

RecordFormat = Literal["instruction", "alpaca", "chat", "sharegpt"]
FORMATS: tuple[str, ...] = ("instruction", "alpaca", "chat", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool",
                  "system": "system"}


class RecordError(ValueError):
    """One row that cannot be used; the message is the reason stats.json reports for it."""


def detect_format(record: dict) -> RecordFormat:
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca" if ("input" in record or "system" in record) else "instruction"
    keys = ", ".join(sorted(record)) or "none"
    raise RecordError(
        f"unrecognised record (keys: {keys}); expected instruction+output, "
        "instruction+input+output(+system), messages, or conversations (ShareGPT)"
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


def _sharegpt_messages(record: dict) -> list[dict]:
    """LLaMA-Factory's ShareGPT turns: an optional leading system turn, then human/observation and
    gpt/function_call alternating, ending with gpt or function_call."""
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise RecordError("'conversations' must be a non-empty list of {from, value}")
    out: list[dict] = []
    system = _text(record, "system", required=False)
    if system.strip():
        out.append({"role": "system", "content": system})
    prompt_side = True  # the next turn must be human or observation
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"conversations[{i}] must be an object {{from, value}}, got {type(turn).__name__}")
        who = turn.get("from")
        if who not in SHAREGPT_ROLES:
            raise RecordError(f"conversations[{i}].from is {who!r}; use one of {', '.join(SHAREGPT_ROLES)}")
        if not isinstance(turn.get("value"), str):
            raise RecordError(f"conversations[{i}].value must be a string, got {type(turn.get('value')).__name__}")
        if who == "system":
            if i != 0 or out:
                raise RecordError(f"conversations[{i}].from is 'system': only the first turn may be (or use the "
                                  "row's 'system' field, not both)")
            out.append({"role": "system", "content": turn["value"]})
            continue
        expected = ("human", "observation") if prompt_side else ("gpt", "function_call")
        if who not in expected:
            raise RecordError(f"conversations[{i}].from is {who!r} where {' or '.join(expected)} was expected "
                              "(turns alternate human/observation, then gpt/function_call)")
        out.append({"role": SHAREGPT_ROLES[who], "content": turn["value"]})
        prompt_side = not prompt_side
    if not out or out[-1]["role"] != "assistant":
        raise RecordError("the last turn of 'conversations' must be from gpt or function_call (it is what is trained)")
    return out


def record_tools(record: object) -> list[dict] | None:
    """A ShareGPT row's `tools` (a JSON string or a list of function definitions) for the chat template; None
    when the row has none."""
    import json

    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RecordError(f"'tools' is not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError("'tools' must be a list of function definitions (objects), or that list as a JSON string")
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]


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
    if found == "sharegpt":
        if "conversations" not in record:
            raise RecordError("format sharegpt needs a 'conversations' list of {from, value}")
        return found, _sharegpt_messages(record)
    return found, _instruction_messages(record, with_extras=found == "alpaca")
