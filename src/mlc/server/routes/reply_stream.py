"""One reply streamed as another API's events (Responses items, Messages content blocks): the chat reader's deltas
(reasoning, content, whole tool calls), as chat completions stream them, handed to a subclass's `text` and `call`."""

from __future__ import annotations

from mlc.server.chat.assistant_output import AssistantOutput


class ReplyStream:
    def __init__(self, reader: AssistantOutput):
        self.reader = reader
        self.deltas: list[dict] = []  # every delta so far: the whole reply, assembled, at the end

    def text(self, kind: str, piece: str) -> list[dict]:
        """Events for a piece of text; `kind` is reasoning or content."""
        raise NotImplementedError

    def call(self, call: dict) -> list[dict]:
        """Events for one whole tool call {id, type, function: {name, arguments}}."""
        raise NotImplementedError

    def feed(self, deltas: list[dict]) -> list[dict]:
        self.deltas += deltas
        events: list[dict] = []
        for delta in deltas:
            if "reasoning_content" in delta:
                events += self.text("reasoning", delta["reasoning_content"])
            elif "content" in delta:
                events += self.text("content", delta["content"])
            for call in delta.get("tool_calls", []):
                events += self.call({k: v for k, v in call.items() if k != "index"})
        return events

    def chunks(self, out) -> list[dict]:
        """Events for one engine output of a one-choice request (rr.stream's render)."""
        (o,) = out.outputs
        return self.feed(self.reader.feed(o.delta_text))

    def rest(self) -> list[dict]:
        """Events for what the reader held back until the end."""
        return self.feed(self.reader.finish())
