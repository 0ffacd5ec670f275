"""Offline API: `LLM(model).generate(prompts, SamplingParams)` runs a whole batch to completion."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from mlc.config.engine_config import EngineConfig
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.outputs import RequestOutput
from mlc.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        engine: LLMEngine | None = None,
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        if engine is None:
            config = EngineConfig(**{**(config or EngineConfig(model=model)).model_dump(), **overrides})
            engine = LLMEngine(config)
        self.engine = engine
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer: PreTrainedTokenizerBase = self.engine.tokenizer
        return tokenizer

    def render_chat(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation under the model's chat template, ready for generation."""
        return self.engine.chat_prompt(messages)[1]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each step's new text for one prompt (used by `mlc-cli chat`)."""
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_progress: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`; `on_progress` is called as each request finishes. A request that an
        engine failure ended has finish_reason "error" and its `error` set; the others are unaffected."""
        batch = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        batch = cast("Sequence[Prompt]", batch)
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError("give one SamplingParams, or one per prompt")
        order = []
        for prompt, p in zip(batch, plist):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(order):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if on_progress:
                        on_progress(out)
        return [done[r] for r in order]

    def chat(self, conversations: list[Message] | list[list[Message]], params: SamplingParams | None = None,
             **kw: Any) -> list[RequestOutput]:
        """One conversation, or a list of them, under the model's chat template."""
        many = conversations if conversations and isinstance(conversations[0], list) else [conversations]
        return self.generate([self.render_chat(c) for c in cast("list[list[Message]]", many)], params, **kw)
