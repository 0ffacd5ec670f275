"""Prompts before the engine: empty chats are refused as empty prompts are, a text too long for the context is
refused before tokenizing, and tokenizing runs off the event loop."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from mlc.errors import ContextLengthError, InvalidRequestError
from mlc.server.chat.messages import chat_messages
from mlc.server.input_policy import InputPolicy
from mlc.server.prompting import check_chars, off_loop
from mlc.server.protocol.schemas import ChatMessage
from mlc.server.token_text import TokenText


class FakeTokenizer:
    def get_vocab(self):
        return {"a": 0, "Ġthe": 1, "ĊĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ": 2}


STATE = SimpleNamespace(policy=InputPolicy(), token_text=TokenText(FakeTokenizer()))


def messages(*pairs) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


@pytest.mark.parametrize("content", ["", "\u200b", [], "\u2060\ufeff"])
def test_chat_without_any_text_is_refused(content):
    with pytest.raises(InvalidRequestError) as e:
        chat_messages(STATE, messages(("user", content)))
    assert e.value.field == "messages" and "empty" in e.value.message


def test_empty_last_user_message_is_refused_even_with_a_system_message():
    with pytest.raises(InvalidRequestError) as e:
        chat_messages(STATE, messages(("system", "Be brief."), ("user", "\u200b")))
    assert e.value.field == "messages[1].content" and "invisible" in e.value.message


def test_empty_assistant_turns_and_system_only_chats_are_fine():
    out, stripped = chat_messages(STATE, messages(("user", "hi"), ("assistant", ""), ("user", "again\u200b")))
    assert [m["content"] for m in out] == ["hi", "", "again"] and stripped == 1
    assert chat_messages(STATE, messages(("system", "Say hello.")))[0][0]["content"] == "Say hello."


def test_text_longer_than_the_context_could_hold_is_refused_before_tokenizing():
    assert STATE.token_text.longest_piece == 33
    check_chars(STATE, 33 * 512, 512, "prompt")  # could just fit at the longest piece per token
    check_chars(STATE, 10**9, None, "prompt")  # no bound (/tokenize)
    with pytest.raises(ContextLengthError) as e:
        check_chars(STATE, 33 * 512 + 1, 512, "prompt[3]")
    assert e.value.field == "prompt[3]" and "512 tokens" in e.value.message


def test_tokenizing_runs_off_the_event_loop():
    async def run():
        return await off_loop(lambda: threading.current_thread().name), threading.current_thread().name

    worker, loop = asyncio.run(run())
    assert worker.startswith("mlc-tokenize") and worker != loop


def test_text_part_without_text_names_the_part():
    chat = [ChatMessage(role="user", content=[{"type": "text", "text": "hi"}, {"type": "text"}])]
    with pytest.raises(InvalidRequestError) as e:
        chat_messages(STATE, chat)
    assert e.value.field == "messages[0].content[1].text" and "missing" in e.value.message
