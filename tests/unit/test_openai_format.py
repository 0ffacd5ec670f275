"""Streaming completions: logprob text offsets count token pieces, whatever text the engine holds back; with echo,
the prompt's tokens come first (the first without a logprob)."""

from __future__ import annotations

from mlc.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mlc.engine.sequence import TokenLogprob
from mlc.server.routes.openai_format import CompletionStream, completion_logprobs

PIECES = {0: "Say: ", 1: "Hi", 2: " there", 3: "\n", 4: "!"}


class Pieces:
    def text(self, token_id: int) -> str:
        return PIECES[token_id]


def output(tokens: list[int], delta: list[int], delta_text: str) -> RequestOutput:
    metrics = RequestMetrics(0.0, None, None, None, [], 1, 0, 0)
    lps = [TokenLogprob(t, -1.0) for t in tokens]
    done = CompletionOutput(0, "".join(PIECES[t] for t in tokens), tokens, None, lps, delta_text, delta,
                            [TokenLogprob(t, -1.0) for t in delta])
    return RequestOutput("r", [0], [done], False, metrics)


def test_stream_offsets_equal_the_non_streaming_ones_when_text_is_held_back():
    tokens = [1, 2, 3, 4]
    stream = CompletionStream("r", 0, "m", Pieces(), 0, 1, False, echo_text="Say: ")
    offsets = []
    # "\n" is held back a step (a possible stop-string prefix), so deltas and tokens do not line up
    for upto, text in ((1, "Hi"), (2, " there"), (3, ""), (4, "\n!")):
        for chunk in stream.chunks(output(tokens[:upto], tokens[upto - 1 : upto], text)):
            offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    whole = completion_logprobs([TokenLogprob(t, -1.0) for t in tokens], Pieces(), False, 0, ([0], []))
    assert offsets == whole.text_offset == [0, 5, 7, 13, 14]
    assert whole.token_logprobs == [None, -1.0, -1.0, -1.0, -1.0]


def test_echo_reports_prompt_logprobs_first():
    lps = completion_logprobs([TokenLogprob(4, -0.5, [(4, -0.5), (1, -2.0)])], Pieces(), True, 0,
                              ([0, 1, 2], [-3.0, -float("inf")]))
    assert lps.tokens == ["Say: ", "Hi", " there", "!"]
    assert lps.token_logprobs == [None, -3.0, -9999.0, -0.5]
    assert lps.top_logprobs == [None, {"Hi": -3.0}, {" there": -9999.0}, {"!": -0.5, "Hi": -2.0}]
