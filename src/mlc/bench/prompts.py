"""Built-in benchmark prompts: varied chat requests, a few long ones, in English and Chinese."""

from __future__ import annotations

from pathlib import Path

from mlc.config.paths import package_data

CHAT_PROMPTS = [
    [{"role": "user", "content": "Explain in detail how a bicycle works, part by part."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "List five uses of Python, with one sentence each."}],
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "user", "content": "请用中文介绍一下长城的历史。"}],
    [{"role": "user", "content": "What is 12 times 13? Show your working step by step."},
     {"role": "assistant", "content": "12 times 13 is 156."},
     {"role": "user", "content": "Now explain how you checked that answer, in several sentences."}],
]

TOPICS = [
    "volcanoes", "the history of the printing press", "how vaccines work", "black holes", "the water cycle",
    "how to bake bread", "the rules of chess", "photosynthesis", "the French revolution", "how a compiler works",
    "honey bees", "the Great Barrier Reef", "electric cars", "the Roman empire", "how to learn a language",
    "jazz music", "the moon landing", "climate and weather", "how the internet routes packets", "origami",
    "the life of a star", "tea ceremonies", "how bridges stay up",
]


def long_text() -> str:
    """Genesis 1-10, King James Version (public domain); see mlc/data/README.md."""
    return Path(package_data("genesis-kjv.txt")).read_text(encoding="utf-8")


def chat_prompts(n: int = 32) -> list[list[dict]]:
    """The five parity prompts, four long ones (chunked prefill), then short varied ones; cycles past 32."""
    text = long_text()
    long = [
        [{"role": "user", "content": f"Summarize this passage in two sentences:\n\n{text[: 1200 + 400 * i]}"}]
        for i in range(4)
    ]
    short = [[{"role": "user", "content": f"Tell me three facts about {t}."}] for t in TOPICS]
    pool = CHAT_PROMPTS + long + short
    return [pool[i % len(pool)] for i in range(n)]
