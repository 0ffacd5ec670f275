"""Prompts as the engine takes them: text through the input policy and the tokenizer, chat messages through the
model's chat template. Tokenizing runs on the event-loop thread only (the engine thread only decodes), so the
tokenizer is never used by two threads in a mutating way."""

from __future__ import annotations

from dataclasses import dataclass

from mlc.errors import InvalidRequestError
from mlc.server.errors import UnsupportedFeatureError
from mlc.server.schemas import ChatMessage
from mlc.server.state import ServerState

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the text the ids came from (None for token-id prompts)
    stripped: int = 0  # invisible characters removed by the input policy


def encode(state: ServerState, text: str, field: str, add_special_tokens: bool = True) -> Prompt:
    clean, stripped = state.policy.clean(text, field)
    if not clean:
        raise InvalidRequestError(f"{field} is empty" + (" once invisible characters are removed" if stripped else "")
                                  + "; send some text", field=field)
    ids = list(state.llm.tokenizer(clean, add_special_tokens=add_special_tokens)["input_ids"])
    return Prompt(ids, clean, stripped)


def from_ids(state: ServerState, ids: list[int], field: str) -> Prompt:
    vocab = state.llm.model.config.vocab_size
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise InvalidRequestError(f"{field}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", field=field)
    return Prompt(list(ids), None)


def chat_messages(state: ServerState, messages: list[ChatMessage]) -> tuple[list[dict], int]:
    """Messages as the chat template takes them ({role, content} with text content), and the characters stripped."""
    out, stripped = [], 0
    for i, m in enumerate(messages):
        field = f"messages[{i}].content"
        if m.tool_calls:
            raise UnsupportedFeatureError("tool calls are not supported by this server",
                                          field=f"messages[{i}].tool_calls")
        if m.content is None:
            raise InvalidRequestError(f"{field} is missing; every message needs text content", field=field)
        if isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise UnsupportedFeatureError(
                        f"content part type {part.type!r} is not supported; this model reads text parts only",
                        field=f"{field}[{j}]")
                parts.append(part.text)
            text = "".join(parts)
        clean, n = state.policy.clean(text, field)
        stripped += n
        out.append({"role": ROLE_ALIASES.get(m.role, m.role), "content": clean})
    return out, stripped


def render(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True) -> Prompt:
    from mlc.models.tokenizer import render_chat

    conversation, stripped = chat_messages(state, messages)
    text = render_chat(state.llm.tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    ids = list(state.llm.tokenizer(text, add_special_tokens=False)["input_ids"])
    return Prompt(ids, text, stripped)

