"""Incremental detokenization on a tiny byte-level BPE (tests/support/tiny_llama.py) whose Chinese tokens split
characters across tokens: streamed deltas, UTF-8 safety, stop strings with hold-back, flush, and the first word's
space."""

from __future__ import annotations

import pytest

from mlc.engine.detokenizer import IncrementalDetokenizer
from tests.support.tiny_llama import build_tokenizer

ENGLISH = "Hello, thank you for contacting us. Your order has shipped and will arrive soon."
CHINESE = "您好，感谢您的耐心等待。订单已发货，请注意查收。"
MIXED = "Your order has shipped! 您好，订单已发货。 Where is my refund? 请注意查收"
TEXTS = [ENGLISH, CHINESE, MIXED, "0123456789 ?!.,:;'\"()[]{}", "感谢"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("detok-tokenizer"))


@pytest.fixture(scope="module")
def prompt(tok):
    return [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("user\nhi") + \
        [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("assistant\n")


class Reader:
    """Hands out the detokenizer's text as the engine does (llm_engine `_output`): the new part of `text` up to
    `releasable(finished)`, never going back."""

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok, self.sent = detok, 0

    def delta(self, finished: bool) -> str:
        start, self.sent = self.sent, max(self.sent, self.detok.releasable(finished))
        return self.detok.text[start : self.sent]


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tok, prompt_ids, out_ids, stop=(), include=False):
    """What the engine does per sampled token: add, flush when the sequence ends, hand out the delta.
    Returns the detokenizer and the deltas; the sequence ends at a stop string or after the last token."""
    d = IncrementalDetokenizer(tok, prompt_ids, list(stop), include)
    r = Reader(d)
    deltas = []
    for i, t in enumerate(out_ids):
        d.add(t)
        finished = d.stopped or i == len(out_ids) - 1
        if finished:
            d.flush()
        deltas.append(r.delta(finished))
        if finished:
            break
    return d, deltas


def emitted_prefixes(deltas):
    acc, out = "", []
    for delta in deltas:
        acc += delta
        out.append(acc)
    return out


def test_the_tokenizer_really_splits_characters_across_tokens(tok):
    """Guard: the UTF-8 tests below only mean something if single tokens decode to broken characters."""
    assert any(decode(tok, [t]).endswith("\ufffd") for t in tok.encode(CHINESE))


# streaming
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(tok, prompt, text):
    out = tok.encode(text)
    d, deltas = stream(tok, prompt, out)
    assert "".join(deltas) == decode(tok, out) == text
    assert d.text == text and not d.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_no_delta_holds_a_broken_character(tok, prompt, text):
    d, deltas = stream(tok, prompt, tok.encode(text))
    assert all("\ufffd" not in delta for delta in deltas)
    assert "\ufffd" not in d.text


def test_text_catches_up_whenever_the_decode_is_whole(tok, prompt):
    out = tok.encode(MIXED)
    d = IncrementalDetokenizer(tok, prompt, [])
    r = Reader(d)
    emitted = ""
    for i, t in enumerate(out):
        d.add(t)
        emitted += r.delta(False)
        so_far = decode(tok, out[: i + 1])
        assert so_far.startswith(emitted) and emitted == d.text  # no stop strings: nothing held but broken bytes
        if not so_far.endswith("\ufffd"):
            assert d.text == so_far


def test_special_tokens_produce_no_text(tok, prompt):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = tok.encode("Hello") + [eos] + tok.encode(" you")
    _, deltas = stream(tok, prompt, out)
    assert "".join(deltas) == "Hello you"


# the first word
def test_the_first_word_keeps_its_leading_space(tok):
    prompt = tok.encode("Hello,")
    out = tok.encode(" thank you")
    _, deltas = stream(tok, prompt, out)
    assert deltas[0].startswith(" t")
    assert "".join(deltas) == " thank you"


def test_a_continued_word_gets_no_space(tok):
    prompt = tok.encode("Hello, t")
    out = tok.encode("hank you")
    _, deltas = stream(tok, prompt, out)
    assert "".join(deltas) == "hank you"


@pytest.mark.parametrize("prompt_text", ["", "x", "Hello, thank", "您好，订单已发货。", ENGLISH])
def test_the_prompt_is_context_only_never_part_of_the_text(tok, prompt_text):
    out = tok.encode(" for contacting us 您好")
    d, deltas = stream(tok, tok.encode(prompt_text), out)
    assert "".join(deltas) == d.text == " for contacting us 您好"


# stop strings
def test_text_is_cut_at_a_stop_string(tok, prompt):
    d, deltas = stream(tok, prompt, tok.encode(ENGLISH), stop=["contacting"])
    assert d.stopped
    assert d.text == "".join(deltas) == "Hello, thank you for "


@pytest.mark.parametrize("stop, expected", [(["k", "thank"], "Hello, "), (["thank", "k"], "Hello, "),
                                            (["ank", "k", "hank"], "Hello, t")])
def test_text_is_cut_at_the_earliest_of_the_stop_strings_a_token_completes(tok, prompt, stop, expected):
    d, deltas = stream(tok, prompt, tok.encode(ENGLISH), stop=stop)  # token 'k' completes all of them at once
    assert d.stopped and d.text == "".join(deltas) == expected


def test_the_first_stop_string_to_appear_ends_the_text(tok, prompt):
    """A stream cannot wait for a longer stop string that starts earlier but is not complete yet."""
    d, deltas = stream(tok, prompt, tok.encode(ENGLISH), stop=["for", "you", "thank you for"])
    assert d.text == "".join(deltas) == "Hello, thank "


def test_include_stop_str_in_output_keeps_the_stop_string(tok, prompt):
    d, deltas = stream(tok, prompt, tok.encode(ENGLISH), stop=["you"], include=True)
    assert d.stopped and d.text == "".join(deltas) == "Hello, thank you"


def test_a_stop_string_spanning_several_tokens(tok, prompt):
    d, deltas = stream(tok, prompt, tok.encode(ENGLISH), stop=["hank y"])
    assert d.text == "".join(deltas) == "Hello, t"


def test_a_multibyte_stop_string(tok, prompt):
    d, deltas = stream(tok, prompt, tok.encode(CHINESE), stop=["订单"])
    assert d.text == "".join(deltas) == "您好，感谢您的耐心等待。"
    d, deltas = stream(tok, prompt, tok.encode(CHINESE), stop=["订单"], include=True)
    assert d.text == "".join(deltas) == "您好，感谢您的耐心等待。订单"


def test_text_after_the_stop_is_ignored(tok, prompt):
    d = IncrementalDetokenizer(tok, prompt, ["you"])
    r = Reader(d)
    for t in tok.encode(ENGLISH):
        d.add(t)
    assert d.stopped and d.text == "Hello, thank "
    d.flush()
    assert r.delta(True) == "Hello, thank "
    assert r.delta(True) == ""


@pytest.mark.parametrize("text", [ENGLISH, MIXED])
def test_text_a_stop_string_removes_is_never_emitted(tok, prompt, text):
    """For every stop string cut from the text: each emitted prefix is a prefix of the final text, which ends
    right before the first occurrence (or right after, with include_stop_str_in_output)."""
    out = tok.encode(text)
    stops = {text[i : i + n] for n in (1, 2, 3, 5, 8) for i in range(0, len(text) - n + 1, 3)}
    stops = {s for s in stops if s.strip()}
    assert len(stops) > 50
    for stop in sorted(stops):
        for include in (False, True):
            d, deltas = stream(tok, prompt, out, stop=[stop], include=include)
            cut = text.index(stop) + (len(stop) if include else 0)
            expected = text[:cut]
            assert d.stopped, stop
            assert d.text == "".join(deltas) == expected, stop
            assert all(expected.startswith(p) for p in emitted_prefixes(deltas)), stop


def test_text_that_could_start_a_stop_string_is_held_back(tok, prompt):
    d = IncrementalDetokenizer(tok, prompt, ["you for"])
    r = Reader(d)
    emitted = ""
    for t in tok.encode("Hello, thank you"):
        d.add(t)
        emitted += r.delta(False)
    assert not d.stopped
    assert emitted == "Hello, tha"  # the last len("you for") - 1 characters wait
    for t in tok.encode(" for"):
        d.add(t)
        emitted += r.delta(d.stopped)
    assert d.stopped and emitted == "Hello, thank "


def test_held_back_text_is_released_when_no_stop_string_comes(tok, prompt):
    out = tok.encode(ENGLISH)
    d, deltas = stream(tok, prompt, out, stop=["zebra crossing"])
    assert not d.stopped
    assert "".join(deltas) == ENGLISH
    assert len(deltas[-1]) >= len("zebra crossing") - 1  # the held tail comes with the final delta


def test_without_stop_strings_nothing_is_held_back(tok, prompt):
    d = IncrementalDetokenizer(tok, prompt, [])
    r = Reader(d)
    emitted = ""
    for t in tok.encode("Hello, thank you"):
        d.add(t)
        emitted += r.delta(False)
        assert emitted == d.text
    assert emitted == "Hello, thank you"


# flush
def test_flush_releases_an_incomplete_tail_at_the_end(tok, prompt):
    out = tok.encode("订单已发货")[:3]  # ends inside 已's bytes
    assert decode(tok, out).endswith("\ufffd")
    d = IncrementalDetokenizer(tok, prompt, [])
    r = Reader(d)
    for t in out:
        d.add(t)
    assert r.delta(False) == "订单"  # the broken character waits
    d.flush()
    assert d.text == decode(tok, out)
    assert r.delta(True) == decode(tok, out)[len("订单"):]


def test_flush_with_nothing_pending_changes_nothing(tok, prompt):
    d = IncrementalDetokenizer(tok, prompt, [])
    r = Reader(d)
    for t in tok.encode("Hello"):
        d.add(t)
    d.flush()
    d.flush()
    assert d.text == "Hello" and r.delta(True) == "Hello"


def test_finishing_releases_everything_held_back(tok, prompt):
    d = IncrementalDetokenizer(tok, prompt, ["abcdef"])
    r = Reader(d)
    for t in tok.encode("Hello, thank you"):
        d.add(t)
    first = r.delta(False)
    assert first + r.delta(True) == "Hello, thank you"


def test_a_stop_string_in_the_flushed_tail_is_still_cut(tok, prompt):
    out = tok.encode("订单已发货")[:3]  # 已 whole inside a token with a broken tail
    d, deltas = stream(tok, prompt, out, stop=["已"])  # the sequence ends (length) right after that token
    assert "已" not in "".join(deltas)
    assert d.text == "订单"
