"""One chat choice's text as the assistant's reply: reasoning, content and tool calls, as stream deltas or whole.

Text goes through the reasoning splitter (templates whose model thinks in <think>) and then, for requests with
tools, the format's tool parser. Both streaming and whole replies run the same `feed`/`finish`, so a streamed reply
assembles to exactly the non-streamed one. Whitespace next to tool calls is dropped; text the parser cannot read as
a call stays content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from mlc.server.chat.reasoning import ReasoningSplitter
from mlc.server.chat.tool_parsers import ParsedCall, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Reply:
    content: str | None
    reasoning: str | None
    calls: list[dict] = field(default_factory=list)  # {id, type, function: {name, arguments}}
    function_call: dict | None = None  # {name, arguments}: the one call of a legacy (functions) request


class AssistantOutput:
    def __init__(self, reasoning: ReasoningSplitter | None = None, tools: ToolParser | None = None,
                 legacy: bool = False):
        self.reasoning = reasoning
        self.tools = tools
        self.legacy = legacy  # OpenAI's deprecated functions: the first call as {"function_call"}, no more
        self.calls = 0
        self._pending_space = ""  # whitespace-only content, shown only if text (not a call) follows
        self._after_call = False

    def feed(self, text: str) -> list[dict]:
        """Delta dicts ({"content"}, {"reasoning_content"} or {"tool_calls"}) that `text` makes certain."""
        if not text:
            return []
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        return self._route(pieces)

    def finish(self) -> list[dict]:
        pieces = self.reasoning.finish() if self.reasoning is not None else []
        out = self._route(pieces)
        if self.tools is not None:
            out += self._events(self.tools.finish())
        if self._pending_space and not self.calls:
            out.append({"content": self._pending_space})
        self._pending_space = ""
        return merge(out)

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict]:
        out: list[dict] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": piece})
            elif self.tools is not None:
                out += self._events(self.tools.feed(piece))
            else:
                out.append({"content": piece})
        return merge(out)

    def _events(self, events) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, ParsedCall):
                self._pending_space, self._after_call = "", True
                if self.legacy:
                    if not self.calls:
                        out.append({"function_call": {"name": event.name, "arguments": event.arguments}})
                    self.calls += 1
                    continue
                call = {"index": self.calls, "id": new_call_id(), "type": "function",
                        "function": {"name": event.name, "arguments": event.arguments}}
                self.calls += 1
                out.append({"tool_calls": [call]})
                continue
            text = event[1]
            if not text.strip():
                self._pending_space += text
                continue
            if self._after_call:  # the separator after a call is not content
                self._pending_space, text, self._after_call = "", text.lstrip(), False
            body = text.rstrip()  # trailing whitespace waits: before a call it is not content either
            out.append({"content": self._pending_space + body})
            self._pending_space = text[len(body):]
        return out

    def reply(self, text: str) -> Reply:
        """The whole reply for a finished text."""
        return assemble(self.feed(text) + self.finish())


def merge(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of the same kind as one."""
    out: list[dict] = []
    for d in deltas:
        key = next(iter(d))
        if out and next(iter(out[-1])) == key:
            out[-1] = {key: out[-1][key] + d[key]}
        else:
            out.append(dict(d))
    return out


def assemble(deltas: list[dict]) -> Reply:
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", [])]
    legacy = next((d["function_call"] for d in deltas if "function_call" in d), None)
    called = bool(calls) or legacy is not None
    return Reply(None if called and not content.strip() else content, reasoning or None, calls, legacy)


def finish_reason(reason: str | None, made_calls: bool, legacy: bool = False) -> str | None:
    """OpenAI's "tool_calls" ("function_call" for the legacy functions) for a reply that stopped after calls."""
    if made_calls and reason == "stop":
        return "function_call" if legacy else "tool_calls"
    return reason
