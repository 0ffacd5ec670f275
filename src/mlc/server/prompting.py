"""Prompts as the engine takes them: text through the input policy and the tokenizer, chat messages through the
model's chat template.

Tokenizing runs on one worker thread (`off_loop`), never on the event loop: a megabyte prompt takes a second to
tokenize and /health must answer meanwhile. One thread, so the tokenizer is still never used by two threads in a
mutating way (the engine thread only decodes). A text with more characters than the context could hold even at the
vocabulary's longest piece per token is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from mlc.errors import ContextLengthError, InvalidRequestError
from mlc.errors import UnsupportedFeatureError
from mlc.server.schemas import ChatMessage
from mlc.server.state import ServerState

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
T = TypeVar("T")

_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlc-tokenize")


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the text the ids came from (None for token-id prompts)
    stripped: int = 0  # invisible characters removed by the input policy


async def off_loop(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on the tokenizer thread."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, fn, *args)


def check_chars(state: ServerState, chars: int, max_tokens: int | None, field: str) -> None:
    """Refuse a text that cannot fit `max_tokens` tokens (None: no bound) before any tokenizing."""
    if max_tokens is None:
        return
    most = max_tokens * state.token_text.longest_piece
    if chars > most:
        raise ContextLengthError(
            f"{field} has {chars} characters: more than {max_tokens} tokens can hold (at most {most} characters, "
            f"at {state.token_text.longest_piece} per token); shorten it or ask for a larger context", field=field)


def encode(state: ServerState, text: str, field: str, add_special_tokens: bool = True,
           max_tokens: int | None = None) -> Prompt:
    clean, stripped = state.policy.clean(text, field)
    if not clean:
        raise InvalidRequestError(f"{field} is empty" + (" once invisible characters are removed" if stripped else "")
                                  + "; send some text", field=field)
    check_chars(state, len(clean), max_tokens, field)
    return Prompt(state.engine.encode(clean, add_special_tokens), clean, stripped)


def from_ids(state: ServerState, ids: list[int], field: str) -> Prompt:
    state.engine.check_token_ids(ids, field)
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
                if part.type == "text" and part.text is None:
                    raise InvalidRequestError(f"{field}[{j}].text is missing; a text part needs its text",
                                              field=f"{field}[{j}].text")
                if part.type != "text":
                    raise UnsupportedFeatureError(
                        f"content part type {part.type!r} is not supported; this model reads text parts only",
                        field=f"{field}[{j}]")
                parts.append(part.text)
            text = "".join(parts)
        clean, n = state.policy.clean(text, field)
        stripped += n
        out.append({"role": ROLE_ALIASES.get(m.role, m.role), "content": clean})
    _require_text(out, stripped)
    return out, stripped


def _require_text(conversation: list[dict], stripped: int) -> None:
    """An empty chat is a 400, as an empty prompt is: no message with text, or an empty last user message."""
    gone = " once invisible characters are removed" if stripped else ""
    if not any(m["content"] for m in conversation):
        raise InvalidRequestError(f"every message's content is empty{gone}; send some text", field="messages")
    users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
    if users and not conversation[users[-1]]["content"]:
        field = f"messages[{users[-1]}].content"
        raise InvalidRequestError(f"{field} is empty{gone}; the last user message needs text", field=field)


def render(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
           max_tokens: int | None = None) -> Prompt:
    conversation, stripped = chat_messages(state, messages)
    check_chars(state, sum(len(m["content"]) for m in conversation), max_tokens, "messages")
    text, ids = state.engine.chat_prompt(conversation, add_generation_prompt)
    return Prompt(ids, text, stripped)

