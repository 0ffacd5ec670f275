"""Incremental detokenization with stop strings.

Text is decoded over a short window of recent tokens and only released once it no longer ends in an incomplete
UTF-8 sequence. While stop strings are set, the last `longest stop - 1` characters are held back, so a stream never
shows text that a stop string later removes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 4  # prompt tokens decoded before the output so the first word gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], stop: list[str],
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far (stop string cut off once found)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def add(self, token_id: int) -> None:
        """Take one new output token; sets `stopped` when a stop string appears."""
        if self.stopped:
            return
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        if not self.stop:
            return
        window_start = max(0, new_from - self.holdback)
        best = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped = True

    def flush(self) -> None:
        """At the end: release any tail still held back for an incomplete character."""
        if self.read_offset < len(self.ids) and not self.stopped:
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            start = len(self.text)
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)
            self._check_stop(start)  # the tail may complete a stop string too

    def releasable(self, finished: bool) -> int:
        """How much of `text` may be shown: all of it once finished or stopped, else all but a possible
        stop-string prefix at its end."""
        return len(self.text) if finished or self.stopped else len(self.text) - self.holdback
