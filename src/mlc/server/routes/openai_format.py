"""Engine outputs as OpenAI objects: completions and chat completions, whole or as stream chunks, with logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlc.server.chat.assistant_output import AssistantOutput, finish_reason
from mlc.server.protocol.schemas import (
    ChoiceLogprobs,
    CompletionLogprobs,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)
from mlc.server.token_text import TokenText

if TYPE_CHECKING:
    from mlc.engine.outputs import CompletionOutput, RequestOutput
    from mlc.engine.sequence import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way


def _lp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def usage_of(outs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(o.num_generated_tokens for o in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(lps: list[TokenLogprob], tt: TokenText, top: bool, offset: int,
                        prompt: tuple[list[int], list[float]] | None = None) -> CompletionLogprobs:
    """Logprobs of generated tokens; with `prompt` (echo: the prompt's ids and their logprobs from token 1 on),
    the prompt's tokens come first, the first with none. The engine scores each prompt token, not alternatives, so
    a prompt token's top_logprobs holds that token alone."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    prompt_ids, prompt_lps = prompt if prompt else ([], [])
    for k, token_id in enumerate(prompt_ids):
        value = None if k == 0 or k > len(prompt_lps) else _lp(prompt_lps[k - 1])
        piece = tt.text(token_id)
        tokens.append(piece)
        offsets.append(offset)
        values.append(value)
        tops.append(None if value is None else {piece: value})
        offset += len(piece)
    for lp in lps:
        piece = tt.text(lp.token_id)
        tokens.append(piece)
        offsets.append(offset)
        values.append(_lp(lp.logprob))
        tops.append({tt.text(i): _lp(v) for i, v in lp.top})
        offset += len(piece)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets,
                              top_logprobs=tops if top else None)


def chat_logprobs(lps: list[TokenLogprob], tt: TokenText) -> ChoiceLogprobs:
    def one(token_id: int, value: float) -> TopLogprob:
        piece = tt.text(token_id)
        return TopLogprob(token=piece, logprob=_lp(value), bytes=list(piece.encode("utf-8")))

    content = []
    for lp in lps:
        head = one(lp.token_id, lp.logprob)
        content.append(TokenLogprobOut(**head.model_dump(), top_logprobs=[one(i, v) for i, v in lp.top]))
    return ChoiceLogprobs(content=content)


class CompletionStream:
    """Chunks of `/v1/completions` with stream=true."""

    def __init__(self, rid: str, created: int, model: str, tt: TokenText, logprobs: int | None, n: int,
                 include_usage: bool, echo_text: str | None = None):
        self.base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        self.tt, self.logprobs, self.include_usage = tt, logprobs, include_usage
        self.echoed = [False] * n
        self.offsets = [len(echo_text or "")] * n  # text_offset of each sample's next token (token pieces)
        self.finished = [False] * n
        self.echo = echo_text

    def chunks(self, out: RequestOutput) -> list[dict]:
        chunks = []
        for o in out.outputs:
            i = o.index
            text = o.delta_text
            first_echo = self.echo is not None and not self.echoed[i]
            echo = (self.echo or "") if first_echo else ""
            new_finish = o.finish_reason is not None and not self.finished[i]
            lps = o.delta_logprobs or []
            if not text and not echo and not lps and not new_finish:
                continue
            logprobs = None
            if self.logprobs is not None:
                prompt = (out.prompt_token_ids, out.prompt_logprobs or []) if first_echo else None
                start = 0 if first_echo else self.offsets[i]
                logprobs = completion_logprobs(lps, self.tt, self.logprobs > 0, start, prompt).model_dump()
                self.offsets[i] += sum(len(self.tt.text(lp.token_id)) for lp in lps)
            text = echo + text
            self.echoed[i] = True
            self.finished[i] = self.finished[i] or new_finish
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason}
            chunks.append({**self.base, "choices": [choice], "usage": None})
        return chunks

    def final(self, last: RequestOutput) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": usage_of([last]).model_dump()}]


class ChatStream:
    """Chunks of `/v1/chat/completions` with stream=true: a role chunk per choice, content deltas, finish."""

    def __init__(self, rid: str, created: int, model: str, tt: TokenText, logprobs: bool, n: int,
                 include_usage: bool, reader: Callable[[], AssistantOutput] = AssistantOutput):
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        self.tt, self.logprobs, self.include_usage = tt, logprobs, include_usage
        self.n = n
        self.finished = [False] * n
        self.readers = [reader() for _ in range(n)]  # each choice's reasoning / content / tool calls

    def _chunk(self, choice: dict) -> dict:
        return {**self.base, "choices": [choice], "usage": None}

    def start(self) -> list[dict]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.n)]

    def chunks(self, out: RequestOutput) -> list[dict]:
        chunks = []
        for o in out.outputs:
            i = o.index
            new_finish = o.finish_reason is not None and not self.finished[i]
            lps = o.delta_logprobs or []
            if not o.delta_text and not lps and not new_finish:
                continue
            reader = self.readers[i]
            deltas = reader.feed(o.delta_text) + (reader.finish() if new_finish else [])
            if not deltas and not lps and not new_finish:
                continue  # text held back: it may still turn out to be a tag
            deltas = deltas or [{"content": ""} if lps else {}]
            logprobs = chat_logprobs(lps, self.tt).model_dump() if self.logprobs and lps else None
            self.finished[i] = self.finished[i] or new_finish
            reason = finish_reason(o.finish_reason, reader.calls > 0, reader.legacy)
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                chunks.append(self._chunk({"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                           "finish_reason": reason if last else None}))
        return chunks

    def final(self, last: RequestOutput) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": usage_of([last]).model_dump()}]


def sorted_outputs(out: RequestOutput) -> list[CompletionOutput]:
    return sorted(out.outputs, key=lambda o: o.index)
