"""Per-request sampling parameters, validated with messages that name the field."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from mlc.engine.grammar import GrammarSpec
from mlc.errors import InvalidRequestError

MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (multiplicative, as in HF)
    presence_penalty: float = 0.0  # OpenAI-style additive, output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: chosen plus top-k
    prompt_logprobs: bool = False  # logprob of every prompt token given the ones before it (scoring, perplexity)
    n: int = 1
    include_stop_str_in_output: bool = False
    full_kv: bool = False  # keep this request's whole KV cache even when the engine runs sparse KV
    speculative: bool = True  # False: never draft for this request, even when the engine has speculative decoding
    prediction: list[int] | None = None  # tokens the output is expected to repeat (OpenAI's predicted outputs):
    # drafted from by prompt lookup; the output is the same with or without them
    grammar: GrammarSpec | None = None  # structured outputs: what the tokens must follow (compiled by the engine)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (-100 bans it)
    max_tokens: InitVar[int | None] = None  # vLLM's and OpenAI's name for max_new_tokens (read back as .max_tokens)

    def __post_init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None:
            default = SamplingParams.__dataclass_fields__["max_new_tokens"].default
            if self.max_new_tokens not in (default, max_tokens):
                raise InvalidRequestError(
                    f"max_tokens={max_tokens!r} and max_new_tokens={self.max_new_tokens!r} disagree; give one of them",
                    field="max_tokens")
            self.max_new_tokens = max_tokens
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "must be an integer >= 1 (an empty completion is never what a caller wants)"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 (greedy) and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be -1, 0 (off) or a positive integer"),
            ("min_p", 0.0 <= self.min_p < 1.0, "must be in [0, 1)"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= 64, "must be an integer from 1 to 64"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be from 0 to 20"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens, "must be in [0, max_new_tokens]"),
            ("stop", len(self.stop) <= 16, "allows at most 16 stop strings"),
            ("logit_bias", all(-MAX_BIAS <= b <= MAX_BIAS for b in (self.logit_bias or {}).values()),
             f"biases must be from -{MAX_BIAS:g} to {MAX_BIAS:g}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name}={getattr(self, name)!r} {why}", field=name)


def _max_tokens(self: SamplingParams) -> int:
    return self.max_new_tokens


def _set_max_tokens(self: SamplingParams, value: int) -> None:
    self.max_new_tokens = value


# After the dataclass is built (its __init__ keeps the InitVar's default), so that `params.max_tokens` reads and
# writes max_new_tokens as vLLM code expects.
SamplingParams.max_tokens = property(_max_tokens, _set_max_tokens)  # type: ignore[attr-defined]
