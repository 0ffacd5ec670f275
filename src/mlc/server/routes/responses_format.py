"""The chat path's reply as a Responses API object: output items (reasoning, message, function_call), the
response's status, and the stream's events (`ResponsesStream`), built from the same reader deltas
(`AssistantOutput`: reasoning_content, content, tool_calls) that chat completions stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from mlc.server.chat.assistant_output import AssistantOutput, Reply, assemble
from mlc.server.routes.reply_stream import ReplyStream

RESPONSE_FIELDS = ("instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p", "tools",
                   "tool_choice", "parallel_tool_calls", "text", "reasoning", "truncation", "store", "metadata")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, item_id: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": status}


def output_items(reply: Reply) -> list[dict]:
    items = [reasoning_item(reply.reasoning, new_id("rs"))] if reply.reasoning else []
    if reply.content or not reply.calls:
        items.append(message_item(reply.content or "", new_id("msg")))
    return items + [call_item(c) for c in reply.calls]


def assistant_message(reply: Reply) -> dict:
    """The reply as a chat message, for the stored conversation that previous_response_id continues."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content if reply.calls else reply.content or ""}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = reply.calls
    return message


def status_of(finish: str | None) -> tuple[str, dict | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish in ("abort", "timeout"):
        return "incomplete", None
    return "completed", None


def usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens":
            output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def request_echo(body: Any) -> dict:
    """What a Response repeats of its request."""
    echo = {k: getattr(body, k) for k in RESPONSE_FIELDS}
    echo["tools"] = echo["tools"] or []
    echo["tool_choice"] = echo["tool_choice"] or "auto"
    echo["parallel_tool_calls"] = True if echo["parallel_tool_calls"] is None else echo["parallel_tool_calls"]
    echo["text"] = echo["text"] or {"format": {"type": "text"}}
    echo["truncation"] = echo["truncation"] or "disabled"
    echo["store"] = True if echo["store"] is None else echo["store"]
    echo["metadata"] = echo["metadata"] or {}
    return echo


def response_object(rid: str, created: int, model: str, echo: dict, output: list[dict], finish: str | None,
                    usage_: dict | None) -> dict:
    status, details = status_of(finish)
    done = int(time.time()) if status != "in_progress" else None
    return {"id": rid, "object": "response", "created_at": created, "completed_at": done, "status": status,
            "model": model, "output": output, "error": None, "incomplete_details": details, **echo, "usage": usage_}


class ResponsesStream(ReplyStream):
    """Stream events of one reply: an item opens when its first delta comes (closing the one before), deltas
    follow, and `final` closes the last and sends response.completed with the whole response."""

    def __init__(self, rid: str, created: int, model: str, echo: dict, reader: AssistantOutput,
                 on_done: Callable[[dict, Reply], None] | None = None):
        super().__init__(reader)
        self.rid, self.created, self.model, self.echo, self.on_done = rid, created, model, echo, on_done
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item receiving deltas: reasoning or content (a message)

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _snapshot(self, status: str, finish: str | None = None, usage_: dict | None = None) -> dict:
        resp = response_object(self.rid, self.created, self.model, self.echo, list(self.output), finish, usage_)
        return {**resp, "status": status, "completed_at": None} if status == "in_progress" else resp

    def start(self) -> list[dict]:
        snap = self._snapshot("in_progress")
        return [self._event("response.created", response=snap), self._event("response.in_progress", response=snap)]

    def _open(self, kind: str) -> list[dict]:
        events = self._close()
        index = len(self.output)
        if kind == "reasoning":
            item, part = reasoning_item("", new_id("rs"), "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(None, new_id("msg"), "in_progress"), text_part("")
        self.open = {"kind": kind, "item": item, "index": index, "text": ""}
        self.output.append(item)
        return events + [self._event("response.output_item.added", output_index=index, item=dict(item)),
                         self._event("response.content_part.added", output_index=index, item_id=item["id"],
                                     content_index=0, part=part)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, item, index, text = self.open["kind"], self.open["item"], self.open["index"], self.open["text"]
        self.open = None
        done = reasoning_item(text, item["id"]) if kind == "reasoning" else message_item(text, item["id"])
        self.output[index] = done
        part = done["content"][0]
        text_done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        ids = {"output_index": index, "item_id": item["id"]}
        return [self._event(text_done, **ids, content_index=0, text=text),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=done)]

    def text(self, kind: str, piece: str) -> list[dict]:
        events = self._open(kind) if self.open is None or self.open["kind"] != kind else []
        assert self.open is not None
        self.open["text"] += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return events + [self._event(name, output_index=self.open["index"], item_id=self.open["item"]["id"],
                                     content_index=0, delta=piece)]

    def call(self, call: dict) -> list[dict]:
        events = self._close()
        index, done = len(self.output), call_item(call)
        self.output.append(done)
        ids = {"output_index": index, "item_id": done["id"]}
        return events + [
            self._event("response.output_item.added", output_index=index,
                        item={**done, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", **ids, delta=done["arguments"]),
            self._event("response.function_call_arguments.done", **ids, arguments=done["arguments"]),
            self._event("response.output_item.done", output_index=index, item=done)]

    def final(self, last) -> list[dict]:
        (o,) = last.outputs
        events = self.rest()
        if not self.output:  # an empty reply is still one (empty) message
            events += self._open("content")
        events += self._close()
        resp = response_object(self.rid, self.created, self.model, self.echo, self.output, o.finish_reason,
                               usage(len(last.prompt_token_ids), last.num_generated_tokens))
        if self.on_done is not None:
            self.on_done(resp, assemble(self.deltas))
        # response.completed even when the response is incomplete (max_output_tokens): the openai client's stream
        # helper and the Agents SDK wait for that event, and its response's status says which (as vLLM does)
        return events + [self._event("response.completed", response=resp)]

    def failed(self, message: str, code: str, param: str | None) -> list[dict]:
        return [self._event("error", code=code, message=message, param=param)]
