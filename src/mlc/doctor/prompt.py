"""Doctor check of a prompt file: invisible characters that change tokenization, with their positions."""

from __future__ import annotations

import unicodedata
from pathlib import Path

from mlc.doctor.check import Check

# Visible on screen as nothing (or a plain space) but changes tokenization: format characters (Cf: U+200B..U+200F,
# U+2060, U+FEFF, bidi controls), controls other than tab/newline, line/paragraph separators.
_ALLOWED_CONTROLS = {"\t", "\n", "\r"}
_EXTRA_INVISIBLE = {"\u2028", "\u2029", "\u3164", "\u115f", "\u1160", "\uffa0"}


def invisible_characters(text: str) -> list[tuple[int, int, str]]:
    """(line, column, character) of each invisible character, 1-based."""
    found = []
    for line_no, line in enumerate(text.split("\n"), 1):
        for col, ch in enumerate(line, 1):
            if ch in _ALLOWED_CONTROLS:
                continue
            cat = unicodedata.category(ch)
            if cat == "Cf" or cat == "Cc" or ch in _EXTRA_INVISIBLE:
                found.append((line_no, col, ch))
    return found


def describe_char(ch: str) -> str:
    return f"U+{ord(ch):04X} {unicodedata.name(ch, 'CONTROL CHARACTER')}"


def check_prompt_file(path: Path, limit: int = 20) -> Check:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return Check("prompt file", "fail", f"{path} does not exist", "check the path")
    except UnicodeDecodeError as e:
        return Check("prompt file", "fail", f"{path} is not UTF-8 (byte {e.start})", "re-save it as UTF-8")
    found = invisible_characters(text)
    if not found:
        return Check("prompt file", "ok", f"{path}: {len(text)} characters, no invisible characters")
    items = [f"line {ln} col {col}: {describe_char(ch)}" for ln, col, ch in found[:limit]]
    if len(found) > limit:
        items.append(f"... and {len(found) - limit} more")
    kinds = sorted({f"U+{ord(ch):04X}" for _, _, ch in found})
    return Check("prompt file", "fail", f"{path}: {len(found)} invisible character(s) ({', '.join(kinds)}); "
                 "tokenizers cut or split prompts at them and answers come back empty",
                 "delete them at the positions listed (the server strips them unless strict_input: true); "
                 f"`grep -nP '[\\x{{200B}}-\\x{{200F}}\\x{{2060}}\\x{{FEFF}}]' {path}` shows the lines", items)
