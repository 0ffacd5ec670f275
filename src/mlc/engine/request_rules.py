"""Every rule a request must meet before the engine takes it, in one place: a prompt, token ids of this
vocabulary, a top_k the vocabulary allows, a grammar that compiles, room for the completion within the context, and
KV pages enough for the whole sequence. Each broken rule is the typed error (HTTP 400/413) naming its field.

The engine checks a request when it is added; a server checks it once beforehand (on its own thread), then adds it
as validated. The grammars compiled here, once per distinct spec, are the ones the engine's sequences follow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlc.engine.grammar import Grammar, GrammarCompiler, GrammarSpec
from mlc.engine.page_manager import PageManager
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sparse_kv import SparseKV
from mlc.errors import ContextLengthError, InvalidRequestError, RequestTooLargeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestRules:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], vocab_size: int, max_seq_len: int,
                 pages: PageManager, sparse: SparseKV | None, step_tokens: int) -> None:
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, eos_ids, vocab_size
        self.max_seq_len, self.pages, self.sparse, self.step_tokens = max_seq_len, pages, sparse, step_tokens
        self._grammars: GrammarCompiler | None = None

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """`spec` compiled for this tokenizer, once per distinct spec (a 400 naming its field when it cannot be);
        safe from any thread."""
        if self._grammars is None:  # llguidance's view of the tokenizer takes about a second: built on first use
            self._grammars = GrammarCompiler(self.tokenizer, self.eos_ids, self.vocab_size)
        return self._grammars.compile(spec)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        """Token ids must name tokens of this vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{field}: token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})", field=field)

    def validate(self, ids: list[int], params: SamplingParams, context: int | None = None,
                 context_source: str = "the context limit") -> None:
        """Raise what adding this request would raise; safe from any thread. `context` bounds prompt + completion
        below the model's own limit (a server's context profile), `context_source` says where it comes from."""
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", field="prompt")
        self.check_token_ids(ids, "prompt")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias")
        self.check_token_ids(params.prediction or [], "prediction")
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(f"top_k={params.top_k} is more than the model's {self.vocab_size} tokens; use "
                                      f"at most {self.vocab_size}, or 0 or -1 to turn top_k off", field="top_k")
        if params.grammar is not None:
            self.compile_grammar(params.grammar)
        self._check_context(len(ids), params.max_new_tokens, context, context_source)
        self._check_pages(len(ids), params.max_new_tokens, params.n, params.full_kv)

    def _check_context(self, prompt: int, completion: int, context: int | None, source: str) -> None:
        limit = min(context or self.max_seq_len, self.max_seq_len)
        if context is None or context >= self.max_seq_len:
            source = f"the context limit of {self.max_seq_len} tokens"
        room = limit - prompt
        if room < 1:
            raise ContextLengthError(f"the prompt has {prompt} tokens, which leaves no room for a completion within "
                                     f"{source}; shorten the prompt", field="prompt")
        if completion > room:
            raise ContextLengthError(f"prompt ({prompt} tokens) + max_new_tokens ({completion}) exceeds {source}; "
                                     f"lower max_new_tokens to at most {room}", field="max_new_tokens")

    def _check_pages(self, prompt: int, completion: int, n: int, full_kv: bool) -> None:
        """All `n` samples at full length must fit the cache at once: they share the prompt's full pages and each
        needs the rest of its own (a request the pool can never hold would wait, or be preempted, for ever)."""
        tokens = prompt + completion
        if self.sparse is not None and not full_kv:
            need = n * self.pages.pages_for(self.sparse.policy.max_entries(tokens, self.step_tokens))
        else:
            shared = prompt // self.pages.page_size if n > 1 else 0
            need = shared + n * (self.pages.pages_for(tokens) - shared)
        if need > self.pages.usable_pages:
            samples = f" for its {n} samples" if n > 1 else ""
            raise RequestTooLargeError(f"this request needs {need} KV pages{samples} but the cache holds "
                                       f"{self.pages.usable_pages}; raise --kv-cache-memory or shorten the request"
                                       + (" or lower n" if n > 1 else ""), field="max_new_tokens")
