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


def read_prompt_rows(path: Path | str, what: str = "prompts file") -> list[dict]:
    """JSONL rows, each with a "prompt" string or a "messages" list (other keys are kept for the caller)."""
    import json

    from mlc.errors import DataError

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what} {path}: cannot read ({e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg}); each line must be one JSON object") from None
        ok = isinstance(row, dict) and (
            isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list))
        if not ok:
            raise DataError(f'{path}:{n}: each line needs a "prompt" string or a "messages" list')
        rows.append(row)
    if not rows:
        raise DataError(f"{path} has no prompts")
    return rows


def as_conversation(row: dict) -> list[dict]:
    return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
