"""Each token id's own text (for logprobs and /tokenize), cached: the same ids come back all the time."""

from __future__ import annotations

from functools import lru_cache


class TokenText:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
