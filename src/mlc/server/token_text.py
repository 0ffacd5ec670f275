"""Each token id's own text (for logprobs and /tokenize), cached: the same ids come back all the time."""

from __future__ import annotations

from functools import cached_property, lru_cache


class TokenText:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @cached_property
    def longest_piece(self) -> int:
        """Characters in the longest vocabulary entry: a text of N characters needs at least N / this many tokens.

        Byte-level pieces count bytes (at least one per character) and SentencePiece's one-for-one, so it bounds."""
        return max(8, max(len(piece) for piece in self._tokenizer.get_vocab()))
