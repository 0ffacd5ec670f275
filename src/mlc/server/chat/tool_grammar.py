"""The grammar that forces a tool call (tool_choice required or a named function), in the model's own format, so
the reply always parses. Lark for llguidance, with each tool's JSON Schema inline (`%json`).

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: one, or one or more when the request
  says parallel_tool_calls: true and names no function (left free to go on, a model that does not know the format
  keeps adding calls until max_tokens cuts the last one).
- glm45: an empty `<think></think>` (a forced call skips reasoning), then `<tool_call>NAME` and one
  `<arg_key>`/`<arg_value>` pair per argument: the required ones in schema order, then the optional ones, each
  optional. String values are text without "<" (bounded by maxLength); others are JSON.
- glm4: the function name on a line, then its JSON arguments (one call: GLM-4 makes one per turn).
- llama3_json: `{"name": ..., "parameters": {...}}`.
"""

from __future__ import annotations

import json
import re

from mlc.engine.grammar import JSON_STYLE, GrammarSpec
from mlc.server.chat.tools import ToolSetup

STYLE = {"x-guidance": JSON_STYLE}
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>")
_TAG = re.compile("(" + "|".join(re.escape(t) for t in TAGS) + ")")


class Lit:
    """Lark for a literal text. A tag that the tokenizer holds as one added token (GLM-4.5's) must be that token:
    llguidance treats added tokens as special and never spells them from text, so it is written as `<[id]>`."""

    def __init__(self, added_vocab: dict[str, int]):
        self.ids = {t: added_vocab[t] for t in TAGS if t in added_vocab}

    def __call__(self, text: str) -> str:
        parts = [p for p in _TAG.split(text) if p]
        return " ".join(f"<[{self.ids[p]}]>" if p in self.ids else json.dumps(p, ensure_ascii=False) for p in parts)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, **STYLE}, ensure_ascii=False)


def _string_value(schema: dict, lit: Lit) -> str:
    """A GLM-4.5 string argument: its enum, or text without "<" within its length bounds."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(lit(v) for v in schema["enum"]) + ")"
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    bound = f"{{{low},{int(high)}}}" if high is not None else (f"{{{low},}}" if low else "*")
    return f"/[^<]{bound}/"


def _glm45_call(k: int, name: str, schema: dict, lit: Lit) -> list[str]:
    props = schema.get("properties") or {}
    required = [p for p in schema.get("required") or [] if p in props]
    rules, parts = [], []
    for j, prop in enumerate(required + [p for p in props if p not in required]):
        sub = props[prop] if isinstance(props[prop], dict) else {}
        value = _string_value(sub, lit) if sub.get("type") == "string" else _json(sub)
        rules.append(f"a{k}_{j}: {lit(chr(10) + '<arg_key>' + prop + '</arg_key>' + chr(10) + '<arg_value>')} {value} "
                     f"{lit('</arg_value>')}")
        parts.append(f"a{k}_{j}" + ("" if prop in required else "?"))
    rules.append(f"c{k}: {lit('<tool_call>' + name)} {' '.join(parts)} {lit(chr(10) + '</tool_call>')}")
    return rules


def _closed(schema: dict) -> dict:
    """A forced call carries the declared arguments only: an object schema that lists its properties and does not
    say otherwise gets additionalProperties false (OpenAI's strict function calling asks for the same)."""
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def _schemas(setup: ToolSetup) -> dict[str, dict]:
    chosen = {setup.named: setup.schemas[setup.named]} if setup.named else setup.schemas
    return {name: _closed(schema) for name, schema in chosen.items()}


def tool_call_lark(setup: ToolSetup, added_vocab: dict[str, int] | None = None) -> str:
    """The Lark grammar; `added_vocab` (the tokenizer's added tokens) says which tags are single tokens."""
    lit = Lit(added_vocab or {})
    schemas = _schemas(setup)
    many = setup.parallel and not setup.named
    if setup.format == "glm45":
        rules = [r for k, (n, s) in enumerate(schemas.items()) for r in _glm45_call(k, n, s, lit)]
        calls = " | ".join(f"c{k}" for k in range(len(schemas)))
        head = f'start: "\\n"? ({lit("<think></think>")} "\\n"?)? call' + (' ("\\n" call)*' if many else "")
        return "\n".join([head, f"call: {calls}", *rules])
    if setup.format == "glm4":
        alts = [f"c{k}: {lit(name + chr(10))} {_json(s)}" for k, (name, s) in enumerate(schemas.items())]
        return "\n".join(["start: " + " | ".join(f"c{k}" for k in range(len(schemas))), *alts])
    key = "parameters" if setup.format == "llama3_json" else "arguments"
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, key: s}, "required": ["name", key],
                      "additionalProperties": False} for n, s in schemas.items()]}
    if setup.format == "llama3_json":
        return f"start: {_json(one)}"
    head = "start: call" + (' ("\\n" call)*' if many else "")
    return "\n".join([head, f"call: {lit('<tool_call>' + chr(10))} {_json(one)} {lit(chr(10) + '</tool_call>')}"])


def tool_call_grammar(setup: ToolSetup, added_vocab: dict[str, int] | None = None) -> GrammarSpec:
    return GrammarSpec("lark", tool_call_lark(setup, added_vocab))
