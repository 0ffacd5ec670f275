"""One finding of `mlc-cli doctor`: what was checked, how it went, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""
    items: list[str] = field(default_factory=list)  # per-finding lines (positions, files)
