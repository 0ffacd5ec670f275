"""Invisible characters in prompts: stripped by default (and counted), or rejected with --strict-input.

Unicode format characters (category Cf: U+200B zero-width space, U+2060 word joiner, U+FEFF BOM, U+00AD soft
hyphen, bidi controls, tag characters U+E0000..U+E007F) are invisible to whoever reads a prompt but are tokens to
the model: some tokenizers cut the prompt at them (the reference tutorial's empty answers) and they can hide text.
Two of them carry meaning and are kept: U+200C (ZWNJ) and U+200D (ZWJ), needed by Persian and Indic scripts and by
emoji sequences.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from dataclasses import dataclass
from functools import cache

from mlc.errors import InvalidRequestError

KEPT = frozenset("\u200c\u200d")
STRIPPED_HEADER = "x-mlc-stripped-chars"


def is_invisible(ch: str) -> bool:
    return unicodedata.category(ch) == "Cf" and ch not in KEPT


@cache
def _invisible() -> re.Pattern:
    """One character class of every invisible character: a scan in C, not a Python loop over a long prompt."""
    chars = (chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf")
    return re.compile("[" + "".join(re.escape(ch) for ch in chars if ch not in KEPT) + "]")


@dataclass(frozen=True)
class InputPolicy:
    strict: bool = False

    def clean(self, text: str, field: str) -> tuple[str, int]:
        """(text without invisible characters, how many were removed); raises in strict mode instead."""
        pattern = _invisible()
        if pattern.search(text) is None:
            return text, 0
        clean, count = pattern.subn("", text)
        if self.strict:
            first = zip(range(5), pattern.finditer(text))
            where = ", ".join(f"U+{ord(m.group()):04X} at {m.start()}" for _, m in first)
            more = f" and {count - 5} more" if count > 5 else ""
            raise InvalidRequestError(
                f"{field} contains {count} invisible format character(s) ({where}{more}); remove them, "
                "or run the server without --strict-input to have them stripped",
                field=field,
            )
        return clean, count
