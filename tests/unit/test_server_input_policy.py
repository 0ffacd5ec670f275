"""The invisible-character policy: strip and count by default, reject with --strict-input."""

from __future__ import annotations

import pytest

from mlc.errors import InvalidRequestError
from mlc.server.input_policy import InputPolicy, is_invisible


@pytest.mark.parametrize("ch", ["\u200b", "\u2060", "\ufeff", "\u00ad", "\u202e", "\U000e0041"])
def test_format_characters_are_invisible(ch):
    assert is_invisible(ch)


@pytest.mark.parametrize("ch", ["\u200c", "\u200d", "a", " ", "\n", "\u4e2d", "\U0001f600"])
def test_visible_and_meaningful_characters_are_kept(ch):
    assert not is_invisible(ch)


def test_strip_counts_what_it_removed():
    text, n = InputPolicy().clean("he\u200bllo\u2060 wor\ufeffld", "prompt")
    assert (text, n) == ("hello world", 3)


def test_clean_text_is_untouched():
    assert InputPolicy().clean("plain text, 中文", "prompt") == ("plain text, 中文", 0)
    assert InputPolicy(strict=True).clean("plain", "prompt") == ("plain", 0)


def test_emoji_sequences_survive():
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"
    assert InputPolicy().clean(family, "prompt") == (family, 0)


def test_strict_rejects_naming_field_and_code_points():
    with pytest.raises(InvalidRequestError) as e:
        InputPolicy(strict=True).clean("a\u200bb\u2060", "messages[2].content")
    assert e.value.field == "messages[2].content"
    assert "U+200B at 1" in e.value.message and "U+2060 at 3" in e.value.message
    assert "--strict-input" in e.value.message


def test_strict_message_is_bounded_for_many_characters():
    with pytest.raises(InvalidRequestError) as e:
        InputPolicy(strict=True).clean("\u200b" * 50, "prompt")
    assert "50 invisible" in e.value.message and "and 45 more" in e.value.message
