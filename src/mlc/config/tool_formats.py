"""The tool-call formats the server reads (`server/chat/tool_parsers.py`), by name, for --tool-call-parser."""

from __future__ import annotations

TOOL_CALL_FORMATS = ("glm45", "glm4", "hermes", "llama3_json")
# Other tools' parser names (vLLM, llama.cpp) for the same formats.
ALIASES = {"glm4_moe": "glm45", "glm47": "glm45", "glm5": "glm45", "chatglm": "glm4", "llama3": "llama3_json",
           "llama3.1": "llama3_json", "qwen": "hermes", "qwen25": "hermes"}


def tool_format_name(name: str) -> str | None:
    """The canonical format name for `name` or one of its aliases; None if unknown."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    return key if key in TOOL_CALL_FORMATS else None
