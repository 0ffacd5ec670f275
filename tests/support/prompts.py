"""Fixed prompts shared by the numerics, engine and benchmark tests (the benchmark's own built-in set)."""

from mlc.bench.prompts import CHAT_PROMPTS, chat_prompts

__all__ = ["CHAT_PROMPTS", "chat_prompts"]
