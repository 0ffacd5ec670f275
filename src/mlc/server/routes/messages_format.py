"""The chat path's reply as an Anthropic message: content blocks (thinking, text, tool_use), stop_reason, usage,
and the stream's events (`MessagesStream`), built from the same reader deltas (`AssistantOutput`) that chat
completions stream."""

from __future__ import annotations

import json
from collections.abc import Callable

from mlc.server.chat.assistant_output import AssistantOutput, Reply
from mlc.server.routes.reply_stream import ReplyStream

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def stop_reason(finish: str | None, made_calls: bool, stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_use(call: dict) -> dict:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"] or "{}")}


def content_blocks(reply: Reply) -> list[dict]:
    blocks = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
    if reply.content or not (reply.calls or reply.reasoning):
        blocks.append({"type": "text", "text": reply.content or ""})
    return blocks + [tool_use(c) for c in reply.calls]


def usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def message_object(mid: str, model: str, content: list[dict], reason: str | None, stop_sequence: str | None,
                   usage_: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage_}


class MessagesStream(ReplyStream):
    """message_start and a ping, then each block as start / deltas / stop (a block opens with its first delta and
    closes when another kind begins), then message_delta (stop_reason, output tokens) and message_stop."""

    def __init__(self, mid: str, model: str, reader: AssistantOutput, matched_stop: Callable[[object], str | None]):
        super().__init__(reader)
        self.mid, self.model, self.matched_stop = mid, model, matched_stop
        self.blocks = 0
        self.open: str | None = None  # the block receiving deltas: reasoning (thinking) or content (text)
        self.calls = 0

    def start(self, prompt_tokens: int) -> list[dict]:
        message = message_object(self.mid, self.model, [], None, None, usage(prompt_tokens, 0))
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        self.blocks += 1
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def text(self, kind: str, piece: str) -> list[dict]:
        events = []
        if self.open != kind:
            events = self._close()
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else \
                {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self.blocks, "content_block": start})
            self.open = kind
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "reasoning" else \
            {"type": "text_delta", "text": piece}
        return events + [{"type": "content_block_delta", "index": self.blocks, "delta": delta}]

    def call(self, call: dict) -> list[dict]:
        events, block, index = self._close(), tool_use(call), self.blocks
        self.blocks += 1
        self.calls += 1
        return events + [
            {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
            {"type": "content_block_delta", "index": index,
             "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}},
            {"type": "content_block_stop", "index": index}]

    def final(self, last) -> list[dict]:
        (o,) = last.outputs
        events = self.rest()
        if self.blocks == 0 and self.open is None:  # an empty reply is still one (empty) text block
            events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
            self.open = "content"
        events += self._close()
        stop = self.matched_stop(o)
        delta = {"stop_reason": stop_reason(o.finish_reason, self.calls > 0, stop), "stop_sequence": stop}
        return events + [{"type": "message_delta", "delta": delta, "usage": {"output_tokens": len(o.token_ids)}},
                         {"type": "message_stop"}]

    @staticmethod
    def failed(status: int, message: str) -> list[dict]:
        return [{"type": "error", "error": {"type": error_type(status), "message": message}}]
