"""Invisible characters in prompts: stripped by default (and counted), or rejected with --strict-input.

Unicode format characters (category Cf: U+200B zero-width space, U+2060 word joiner, U+FEFF BOM, U+00AD soft
hyphen, bidi controls, tag characters U+E0000..U+E007F) are invisible to whoever reads a prompt but are tokens to
the model: some tokenizers cut the prompt at them (the reference tutorial's empty answers) and they can hide text.
Two of them carry meaning and are kept: U+200C (ZWNJ) and U+200D (ZWJ), needed by Persian and Indic scripts and by
emoji sequences.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from mlc.errors import InvalidRequestError

KEPT = frozenset("\u200c\u200d")
STRIPPED_HEADER = "x-mlc-stripped-chars"


def is_invisible(ch: str) -> bool:
    return unicodedata.category(ch) == "Cf" and ch not in KEPT


@dataclass(frozen=True)
class InputPolicy:
    strict: bool = False

    def clean(self, text: str, field: str) -> tuple[str, int]:
        """(text without invisible characters, how many were removed); raises in strict mode instead."""
        found = [(i, ch) for i, ch in enumerate(text) if is_invisible(ch)]
        if not found:
            return text, 0
        if self.strict:
            where = ", ".join(f"U+{ord(ch):04X} at {i}" for i, ch in found[:5])
            more = f" and {len(found) - 5} more" if len(found) > 5 else ""
            raise InvalidRequestError(
                f"{field} contains {len(found)} invisible format character(s) ({where}{more}); remove them, "
                "or run the server without --strict-input to have them stripped",
                field=field,
            )
        drop = {i for i, _ in found}
        return "".join(ch for i, ch in enumerate(text) if i not in drop), len(found)
