"""One Prometheus page for the whole deployment: every replica's `/metrics` text with a `replica` label added to
each sample, families kept together (one HELP and TYPE each), followed by the gateway's own families."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def merge(pages: dict[str, str]) -> str:
    """`pages`: replica id -> its exposition text. Returns one exposition text."""
    families: dict[str, dict] = {}
    for replica, text in pages.items():
        current = None
        label = f'replica="{_escape(replica)}"'
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, {"help": None, "type": None, "samples": []})
                current["help" if line.startswith("# HELP ") else "type"] = line
                continue
            m = _SAMPLE.match(line)
            if m is None or current is None:
                continue
            name, labels, rest = m.groups()
            labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
            current["samples"].append(f"{name}{labels}{rest}")
    out: list[str] = []
    for family in families.values():
        out += [line for line in (family["help"], family["type"]) if line] + family["samples"]
    return "\n".join(out) + "\n" if out else ""


def gauge(name: str, doc: str, values: dict[tuple[tuple[str, str], ...], float], kind: str = "gauge") -> str:
    """A family in exposition text; `values` maps label pairs to the sample value."""
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
    for labels, value in values.items():
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
        suffix = "_total" if kind == "counter" else ""
        lines.append(f"{name}{suffix}{{{inner}}} {value}")
    return "\n".join(lines) + "\n"
