"""Instruction-data record formats -> chat messages.

- instruction: the reference tutorial's `{"instruction": ..., "output": ...}`
- alpaca: `{"instruction", "input", "output", "system"}` (input and system optional)
- chat: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}`
- sharegpt: LLaMA-Factory's `{"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation",
  "value": ...}, ...], "system": ..., "tools": ...}` (system and tools optional); human -> user, gpt and
  function_call -> assistant (the call's JSON text is what is trained), observation -> tool.

A `DatasetSchema` (LLaMA-Factory's dataset_info.json `columns` and `tags`, see mlc.config.dataset_info) gives other
names for these keys and ShareGPT roles; errors name the keys as the rows spell them. Its `formatting` (alpaca or
sharegpt) fixes the format, and an alpaca `history` column adds earlier [prompt, response] turns.
"""

from __future__ import annotations

from typing import Literal, TypeGuard

from mlc.config.dataset_info import DEFAULT_SCHEMA, DatasetSchema

RecordFormat = Literal["instruction", "alpaca", "chat", "sharegpt"]
FORMATS: tuple[str, ...] = ("instruction", "alpaca", "chat", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")


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


def _is_format(fmt: str) -> TypeGuard[RecordFormat]:
    return fmt in FORMATS


def _text(record: dict, key: str | None, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RecordError(f"{key!r} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise RecordError(f"{key!r} is empty")
    return value


def _history(record: dict, key: str | None) -> list[dict]:
    """LLaMA-Factory's alpaca `history`: earlier [prompt, response] pairs, trained like the last turn."""
    pairs = record.get(key) if key else None
    if pairs is None or pairs == []:
        return []
    if not isinstance(pairs, list):
        raise RecordError(f"{key!r} must be a list of [prompt, response] pairs, got {type(pairs).__name__}")
    out = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RecordError(f"{key}[{i}] must be a [prompt, response] pair of strings")
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return out


def _instruction_messages(record: dict, with_extras: bool, schema: DatasetSchema = DEFAULT_SCHEMA) -> list[dict]:
    prompt = _text(record, schema.col("prompt"))
    if with_extras:
        extra = _text(record, schema.col("query"), required=False)
        prompt = f"{prompt}\n\n{extra}" if extra.strip() else prompt
    turns = _history(record, schema.col("history")) if with_extras else []
    turns += [{"role": "user", "content": prompt},
              {"role": "assistant", "content": _text(record, schema.col("response"))}]
    system = _text(record, schema.col("system"), required=False) if with_extras else ""
    return ([{"role": "system", "content": system}] if system.strip() else []) + turns


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


def sharegpt_roles(schema: DatasetSchema = DEFAULT_SCHEMA) -> dict[str, str]:
    """The row's role values -> our roles (`human` -> user, ... or the names `tags` gives)."""
    t = schema.tag
    return {t("user_tag"): "user", t("assistant_tag"): "assistant", t("function_tag"): "assistant",
            t("observation_tag"): "tool", t("system_tag"): "system"}


def _sharegpt_messages(record: dict, schema: DatasetSchema = DEFAULT_SCHEMA) -> list[dict]:
    """LLaMA-Factory's ShareGPT turns: an optional leading system turn, then human/observation and
    gpt/function_call alternating, ending with gpt or function_call (each name as `schema.tags` spells it)."""
    key, role_key, text_key = schema.col("messages"), schema.tag("role_tag"), schema.tag("content_tag")
    user, assistant, function, observation, system_tag = (schema.tag(f"{r}_tag") for r in (
        "user", "assistant", "function", "observation", "system"))
    roles = sharegpt_roles(schema)
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"{key!r} must be a non-empty list of {{{role_key}, {text_key}}}")
    out: list[dict] = []
    system = _text(record, schema.col("system"), required=False)
    if system.strip():
        out.append({"role": "system", "content": system})
    prompt_side = True  # the next turn must be human or observation
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"{key}[{i}] must be an object {{{role_key}, {text_key}}}, got {type(turn).__name__}")
        who = turn.get(role_key)
        if who not in roles:
            raise RecordError(f"{key}[{i}].{role_key} is {who!r}; use one of {', '.join(roles)}")
        if not isinstance(turn.get(text_key), str):
            raise RecordError(f"{key}[{i}].{text_key} must be a string, got {type(turn.get(text_key)).__name__}")
        if who == system_tag:
            if i != 0 or out:
                raise RecordError(f"{key}[{i}].{role_key} is {system_tag!r}: only the first turn may be (or use the "
                                  f"row's {schema.col('system')!r} field, not both)")
            out.append({"role": "system", "content": turn[text_key]})
            continue
        expected = (user, observation) if prompt_side else (assistant, function)
        if who not in expected:
            raise RecordError(f"{key}[{i}].{role_key} is {who!r} where {' or '.join(expected)} was expected "
                              f"(turns alternate {user}/{observation}, then {assistant}/{function})")
        out.append({"role": roles[who], "content": turn[text_key]})
        prompt_side = not prompt_side
    if not out or out[-1]["role"] != "assistant":
        raise RecordError(f"the last turn of {key!r} must be from {assistant} or {function} (it is what is trained)")
    return out


def record_tools(record: object, schema: DatasetSchema = DEFAULT_SCHEMA) -> list[dict] | None:
    """A ShareGPT row's `tools` (a JSON string or a list of function definitions) for the chat template; None
    when the row has none."""
    import json

    key = schema.col("tools")
    tools = record.get(key) if isinstance(record, dict) and key else None
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RecordError(f"{key!r} is not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(f"{key!r} must be a list of function definitions (objects), or that list as a JSON string")
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]


def to_messages(record: object, fmt: str = "auto",
                schema: DatasetSchema = DEFAULT_SCHEMA) -> tuple[RecordFormat, list[dict]]:
    """The record's format and its messages, ending with the assistant turn to learn. A schema from a
    dataset_info.json entry fixes the format (its `formatting`) when `fmt` is auto."""
    if not isinstance(record, dict):
        raise RecordError(f"a row must be a JSON object, got {type(record).__name__}")
    if fmt == "auto" and schema.formatting:
        fmt = schema.formatting
    found: RecordFormat
    if fmt == "auto":
        found = detect_format(record)
    elif _is_format(fmt):
        found = fmt
    else:
        raise RecordError(f"unknown format {fmt!r}; use auto, {', '.join(FORMATS)}")
    if found == "chat":
        if "messages" not in record:
            raise RecordError("format chat needs a 'messages' list")
        return found, _chat_messages(record)
    if found == "sharegpt":
        key = schema.col("messages")
        if key not in record:
            raise RecordError(f"format sharegpt needs a {key!r} list of "
                              f"{{{schema.tag('role_tag')}, {schema.tag('content_tag')}}}")
        return found, _sharegpt_messages(record, schema)
    return found, _instruction_messages(record, with_extras=found == "alpaca", schema=schema)
