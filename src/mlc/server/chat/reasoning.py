"""Reasoning apart from the answer: GLM-4.5+ write `<think>...</think>` before their reply (vLLM's
`reasoning_content`). Fed text as it streams, the splitter hands out each piece as reasoning or content as soon as it
is certain; a tag split across deltas is held back until it completes. /generate and /v1/completions keep the raw
text: only chat replies are split.
"""

from __future__ import annotations

from mlc.server.chat.tool_parsers import held_prefix

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(template: str | None) -> bool:
    """Whether a chat template's model writes a reasoning block (it mentions <think>)."""
    return template is not None and OPEN in template


def starts_inside(prompt_text: str) -> bool:
    """A prompt that ends in an open <think> (some templates open it for the model): the reply starts as
    reasoning."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ReasoningSplitter:
    def __init__(self, inside: bool = False):
        self.state = "think" if inside else "start"  # start: before any text; think; content
        self.buffer = ""
        self.after_think = False  # drop the newlines before the answer (after </think>, or at the very start)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.state, self.buffer = "think", head[len(OPEN) :]
            elif OPEN.startswith(head):
                return out  # nothing yet, or part of the tag
            else:
                self.state, self.after_think = "content", True
        if self.state == "think":
            i = self.buffer.find(CLOSE)
            if i < 0:
                keep = held_prefix(self.buffer, CLOSE)
                piece, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return out + ([("reasoning", piece)] if piece else [])
            if i:
                out.append(("reasoning", self.buffer[:i]))
            self.state, self.buffer, self.after_think = "content", self.buffer[i + len(CLOSE) :], True
        if self.after_think:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return out
            self.after_think = False
        piece, self.buffer = self.buffer, ""
        return out + ([("content", piece)] if piece else [])

    def finish(self) -> list[tuple[str, str]]:
        """The rest: an unclosed reasoning block stays reasoning; text that never began one is content."""
        rest, self.buffer = self.buffer, ""
        if self.state != "think":
            rest = rest.lstrip("\n")
        if not rest:
            return []
        return [("reasoning" if self.state == "think" else "content", rest)]
