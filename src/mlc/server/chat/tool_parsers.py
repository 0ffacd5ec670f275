"""Tool calls in a model's output, one parser per format, fed text as it streams.

- glm45 (GLM-4.5/4.6/4.7/5): `<tool_call>NAME` then `<arg_key>K</arg_key>` `<arg_value>V</arg_value>` pairs, then
  `</tool_call>`; a value is a string where the tool's schema says so, else JSON (then a Python literal, then text).
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (also the generic format, `tools.py`).
- glm4 (GLM-4, GLM-4-0414): the whole reply is a line with the function name, then its JSON arguments.
- llama3_json: the whole reply is `{"name": ..., "parameters": {...}}` (several joined by `;`), maybe after
  `<|python_tag|>`.

`feed(text)` returns events as soon as they are certain: ("content", text) pieces, and a `ParsedCall` once a call
is complete and parses. Text that may still turn into a call is held back; at `finish()` whatever never completed
or never parsed (an unknown function, broken JSON) comes back as content, never as an error.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from mlc.config.tool_formats import TOOL_CALL_FORMATS

PARSER_NAMES = TOOL_CALL_FORMATS


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object


Event = tuple[str, str] | ParsedCall


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (so must wait for more text)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _arguments(value) -> str | None:
    """A JSON object text from arguments given as an object or as a JSON string of one; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class ToolParser:
    def __init__(self, tools: dict[str, dict]):
        self.tools = tools  # function name -> its parameters schema
        self.buffer = ""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        rest, self.buffer = self.buffer, ""
        return [("content", rest)] if rest else []


class TaggedParser(ToolParser):
    """Calls between a start and an end tag, with free text around them."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: dict[str, dict]):
        super().__init__(tools)
        self.in_call = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if not self.in_call:
                i = self.buffer.find(self.START)
                if i < 0:
                    keep = held_prefix(self.buffer, self.START)
                    cut = len(self.buffer) - keep
                    if cut:
                        events.append(("content", self.buffer[:cut]))
                    self.buffer = self.buffer[cut:]
                    return events
                if i:
                    events.append(("content", self.buffer[:i]))
                self.buffer, self.in_call = self.buffer[i:], True
            j = self.buffer.find(self.END)
            if j < 0:
                return events
            block, whole = self.buffer[len(self.START) : j], self.buffer[: j + len(self.END)]
            call = self.parse_block(block)
            events.append(call if call is not None else ("content", whole))
            self.buffer, self.in_call = self.buffer[j + len(self.END) :], False

    def parse_block(self, block: str) -> ParsedCall | None:
        raise NotImplementedError


class HermesParser(TaggedParser):
    def parse_block(self, block: str) -> ParsedCall | None:
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.tools:
            return None
        args = _arguments(obj.get("arguments", obj.get("parameters", {})))
        return ParsedCall(obj["name"], args) if args is not None else None


_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _typed(value: str, schema: dict):
    """A GLM-4.5 argument value as its schema types it: strings stay as written; the rest is JSON or a Python
    literal (True, None, 'x'), else the text itself."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and kind and all(k in ("string", "null") for k in kind)):
        return value
    text = value.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


class Glm45Parser(TaggedParser):
    def parse_block(self, block: str) -> ParsedCall | None:
        cut = [i for i in (block.find("\n"), block.find("<arg_key>")) if i >= 0]
        name = (block[: min(cut)] if cut else block).strip()
        if name not in self.tools:
            return None
        props = (self.tools[name] or {}).get("properties") or {}
        body = block[min(cut):] if cut else ""
        pairs = _PAIR.findall(body)
        if _PAIR.sub("", body).strip():  # text outside the pairs: not a call in this format
            return None
        args = {k.strip(): _typed(v, props.get(k.strip(), {})) for k, v in pairs}
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))


class WholeReplyParser(ToolParser):
    """A reply that is either all text or all call(s), decided by how it starts."""

    def __init__(self, tools: dict[str, dict]):
        super().__init__(tools)
        self.mode: str | None = None  # None: undecided, "text", "call"

    def feed(self, text: str) -> list[Event]:
        if self.mode == "text":
            return [("content", text)] if text else []
        self.buffer += text
        if self.mode is None:
            self.mode = self.decide(self.buffer)
            if self.mode == "text":
                rest, self.buffer = self.text_of(self.buffer), ""
                return [("content", rest)] if rest else []
        return []

    def finish(self) -> list[Event]:
        if self.mode == "call":
            calls = self.parse_calls(self.buffer)
            if calls:
                self.buffer = ""
                return list(calls)
        rest, self.buffer = self.text_of(self.buffer), ""
        return [("content", rest)] if rest else []

    def decide(self, buffer: str) -> str | None:
        raise NotImplementedError

    def parse_calls(self, text: str) -> list[ParsedCall] | None:
        raise NotImplementedError

    def text_of(self, text: str) -> str:
        return text


class Glm4Parser(WholeReplyParser):
    def decide(self, buffer: str) -> str | None:
        line, newline, _ = buffer.partition("\n")
        if newline:
            return "call" if line.strip() in self.tools else "text"
        return None if any(n.startswith(line) for n in self.tools) else "text"

    def parse_calls(self, text: str) -> list[ParsedCall] | None:
        name, _, rest = text.partition("\n")
        try:
            obj, end = json.JSONDecoder().raw_decode(rest.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or rest.strip()[end:].strip():
            return None
        return [ParsedCall(name.strip(), json.dumps(obj, ensure_ascii=False))]

    def text_of(self, text: str) -> str:
        return text[1:] if text.startswith("\n") else text  # the newline GLM-4 writes after <|assistant|>


class Llama3JsonParser(WholeReplyParser):
    TAG = "<|python_tag|>"

    def decide(self, buffer: str) -> str | None:
        head = buffer.lstrip()
        if not head or self.TAG.startswith(head):
            return None  # nothing yet, or maybe the start of the tag
        if head.startswith(self.TAG):
            head = head[len(self.TAG) :].lstrip()
            if not head:
                return None
        return "call" if head.startswith("{") else "text"

    def parse_calls(self, text: str) -> list[ParsedCall] | None:
        text = text.strip().removeprefix(self.TAG).strip()
        calls, decoder = [], json.JSONDecoder()
        while text:
            try:
                obj, end = decoder.raw_decode(text)
            except json.JSONDecodeError:
                return None
            if not isinstance(obj, dict) or obj.get("name") not in self.tools:
                return None
            args = _arguments(obj.get("parameters", obj.get("arguments", {})))
            if args is None:
                return None
            calls.append(ParsedCall(obj["name"], args))
            text = text[end:].strip().removeprefix(";").strip()
        return calls or None


PARSERS: dict[str, type[ToolParser]] = {"glm45": Glm45Parser, "glm4": Glm4Parser, "hermes": HermesParser,
                                        "llama3_json": Llama3JsonParser}


def make_parser(name: str, tools: dict[str, dict]) -> ToolParser:
    return PARSERS[name](tools)
