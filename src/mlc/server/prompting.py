"""Prompts as the engine takes them: text through the input policy and the tokenizer, or token ids checked against
the vocabulary (chat messages through the template: `chat/messages.py`).

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
from mlc.server.state import ServerState, loaded_engine, loaded_token_text

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
    longest = loaded_token_text(state).longest_piece
    most = max_tokens * longest
    if chars > most:
        raise ContextLengthError(
            f"{field} has {chars} characters: more than {max_tokens} tokens can hold (at most {most} characters, "
            f"at {longest} per token); shorten it or ask for a larger context", field=field)


def encode(state: ServerState, text: str, field: str, add_special_tokens: bool = True,
           max_tokens: int | None = None) -> Prompt:
    clean, stripped = state.policy.clean(text, field)
    if not clean:
        raise InvalidRequestError(f"{field} is empty" + (" once invisible characters are removed" if stripped else "")
                                  + "; send some text", field=field)
    check_chars(state, len(clean), max_tokens, field)
    return Prompt(loaded_engine(state).encode(clean, add_special_tokens), clean, stripped)


def from_ids(state: ServerState, ids: list[int], field: str) -> Prompt:
    loaded_engine(state).check_token_ids(ids, field)
    return Prompt(list(ids), None)
