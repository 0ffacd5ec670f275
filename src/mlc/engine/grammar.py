"""Structured outputs: grammars compiled once each by llguidance, cached by what they say, and the token mask the
sampler applies to the rows of constrained sequences.

A request carries a `GrammarSpec` (what to enforce, as text) in `SamplingParams.grammar`. The engine compiles it
(`GrammarCompiler`, once per distinct spec) and gives each of the request's sequences its own matcher, a copy of the
compiled one; the copy lives as long as the sequence (preemption and recompute keep it: the tokens it has seen stay
the sequence's own). The sampler only reads the matchers to mask logits (`GrammarMasks`); the scheduler moves a
matcher on where it appends the sampled token. A step whose batch has no grammar never calls into this module.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mlc.errors import EngineStepError, InvalidRequestError

if TYPE_CHECKING:  # llguidance is imported where it is used: a process without a grammar never loads it
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

# Compact JSON as json.dumps writes it: what models saw in training, and no room to pad with whitespace forever.
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarSpec:
    """What to enforce, in a canonical text form (the cache key). kind: json_schema (source: the schema as JSON),
    json_object, regex, choice (a JSON list of strings), grammar (Lark or GBNF), lark (Lark only: the server's own
    tool-call grammars); strict: refuse schema keywords the grammar engine does not implement rather than ignore
    them."""

    kind: str
    source: str = ""
    strict: bool = True
    field: str = dataclasses.field(default="response_format", compare=False)  # what an error names; not in the key

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, strict: bool = True) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False), strict)

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    def llguidance(self) -> str:
        """This spec as an llguidance grammar (raises ValueError on text that is not even well formed)."""
        import llguidance

        options: JsonCompileOptions = {**JSON_STYLE, "lenient": not self.strict}
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=options)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.source))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if self.kind == "grammar":
            return llguidance.grammar_from("grammar", self.source)  # Lark, or GBNF converted to Lark
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        raise ValueError(f"unknown grammar kind {self.kind!r}; use one of {', '.join(KINDS)}")


class Grammar:
    """A compiled grammar; `matcher()` hands each sequence its own copy in the start state."""

    def __init__(self, spec: GrammarSpec, compiled: LLMatcher, special_ids: torch.Tensor | None = None):
        self.spec = spec
        self._compiled = compiled
        self._lock = threading.Lock()
        self.special_ids = special_ids if special_ids is not None else torch.empty(0, dtype=torch.long)

    def matcher(self) -> LLMatcher:
        with self._lock:
            return self._compiled.deep_copy()

    def __repr__(self) -> str:
        return f"Grammar({self.spec.kind}, {self.spec.source[:60]!r})"


def llguidance_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int], vocab_size: int) -> LLTokenizer:
    """llguidance's view of a transformers fast tokenizer (about a second for a 150k vocabulary: built once)."""
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(
            "structured outputs need llguidance, which is not installed: pip install 'mlc[serve]' (or llguidance)",
            field="response_format") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError("structured outputs need a fast (tokenizers) tokenizer; this model's is not one",
                                  field="response_format")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer, each once: an LRU cache of `CACHE_SIZE` grammars by spec."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int], vocab_size: int,
                 cache_size: int = CACHE_SIZE):
        self._hf = tokenizer
        self._eos = set(eos_token_ids)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._special_ids: torch.Tensor | None = None
        self.compiled = 0  # grammars built (cache misses)
        self.hits = 0

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance_tokenizer(self._hf, self._eos, self.vocab_size)
        return self._tokenizer

    @property
    def special_ids(self) -> torch.Tensor:
        """Tokens llguidance treats as special: EOS, and every added token of the form <...>."""
        if self._special_ids is None:
            tok = self.tokenizer
            self._special_ids = torch.tensor([i for i in range(tok.vocab_size) if tok.is_special_token(i)],
                                             dtype=torch.long)
        return self._special_ids

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The grammar for `spec`, from the cache or built now; a spec the engine cannot compile is a 400 naming
        its field."""
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return found
            grammar = Grammar(spec, self._build(spec), self.special_ids)
            self._cache[spec] = grammar
            self.compiled += 1
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
            return grammar

    def _build(self, spec: GrammarSpec) -> LLMatcher:
        import llguidance

        field = spec.field
        try:
            text = spec.llguidance()
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"{field}: {e}", field=field) from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            why = matcher.get_error().strip().splitlines()[0][:300]
            raise InvalidRequestError(f"{field}: the grammar engine cannot compile this {spec.kind.replace('_', ' ')}"
                                      f" ({why}); fix it or send a simpler one", field=field)
        return matcher


@dataclass
class GuidedRow:
    """One constrained row of a step's logits: its request (for errors), its matcher and the grammar's special ids."""

    row: int
    request_id: str
    matcher: LLMatcher
    special_ids: torch.Tensor


class GrammarMasks:
    """The sampler's side: the masks of a step's constrained rows, filled in parallel from their matchers (which it
    only reads) and applied to the logits."""

    def __init__(self, eos_token_ids: set[int] | None = None):
        self._executor: LLExecutor | None = None
        self._eos = sorted(eos_token_ids or ())

    @staticmethod
    def _checked(g: GuidedRow) -> LLMatcher:
        if g.matcher.is_error():
            raise EngineStepError(f"request {g.request_id}: structured output failed ({g.matcher.get_error()[:200]})")
        return g.matcher

    def apply(self, logits: torch.Tensor, guided: list[GuidedRow], raw: torch.Tensor) -> None:
        """Set the logits of tokens each row's grammar forbids to -inf, in place. A row left with no token (the
        grammar allows only EOS and min_tokens bars it) takes the grammar's mask over `raw` instead: the grammar
        wins. A grammar that allows no token at all ends its sequence with EOS rather than failing the step."""
        import llguidance

        matchers = [self._checked(g) for g in guided]
        rows = [g.row for g in guided]
        vocab = logits.shape[1]
        words = (vocab + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        executor = self._executor = self._executor or llguidance.LLExecutor()
        executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(),
                                               words * 4, len(rows))
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.from_numpy(bits).bool()
        self._drop_refused_specials(allowed, matchers, [g.special_ids for g in guided])
        index = torch.tensor(rows)
        masked = logits[index].masked_fill_(~allowed, float("-inf"))
        dead = torch.isneginf(masked).all(dim=1)
        if dead.any():
            masked[dead] = raw[index[dead]].masked_fill(~allowed[dead], float("-inf"))
            still = torch.isneginf(masked).all(dim=1)
            if still.any() and self._eos:
                eos = torch.tensor(self._eos)
                masked[still.nonzero()[:, 0][:, None], eos[None, :]] = raw[index[still]][:, eos]
        logits[index] = masked

    @staticmethod
    def _drop_refused_specials(allowed: torch.Tensor, matchers: list[LLMatcher], specials: list[torch.Tensor]) -> None:
        """llguidance may let a text-forced step through an added token (GLM's <think> is one) that its matcher
        then refuses; such tokens leave the mask. Specials in a mask are few (EOS, a tag), so this is cheap."""
        for row, (m, ids) in enumerate(zip(matchers, specials)):
            ids = ids[ids < allowed.shape[1]]
            for tid in ids[allowed[row, ids]].tolist():
                if not m.validate_tokens([tid]):
                    allowed[row, tid] = False


def advance(matcher: LLMatcher, token: int) -> None:
    """A sampled token moves its sequence's matcher on (a token outside the mask leaves it in error, which the next
    step reports for that request alone)."""
    if not matcher.is_stopped():
        matcher.consume_token(token)
