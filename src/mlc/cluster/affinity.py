"""Prefix affinity: send a request to the replica that already holds the KV pages of its prompt's prefix, unless
that replica is overloaded.

A prompt's text is cut into chunks of `chunk_chars` characters (about one KV page of tokens) and each chunk gets a
chained hash (parent hash, chunk text, adapter), like the engine's prefix-cache keys: equal hashes mean equal
prefixes up to that chunk. The table remembers which replica last took each chunk. A new request goes to the
replica holding its deepest known chunk; a prefix never seen goes to the replica its first chunk hashes to
(rendezvous hashing, so several gateways agree without talking). If that replica has more than `max_load_gap`
requests in flight beyond the least busy one, the least busy replicas get the request instead.

A chat request with OpenAI's `prompt_cache_key` is routed by that key instead of its text (`affinity_keys`): one
key per model, so every request of a conversation or tenant that shares the key meets the same replica's cache.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, OrderedDict

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
MAX_CHUNKS = 512
DECISIONS: Counter = Counter()  # decision -> requests the router sent (affinity, new_prefix, overloaded, no_prefix)


def _json_body(path: str, body: bytes) -> dict | None:
    if path not in INFERENCE_PATHS or not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def affinity_keys(path: str, body: bytes, chunk_chars: int) -> tuple[str, ...]:
    """What the router matches replicas by: the request's prompt_cache_key (one key, per model) when it sends one,
    else its prompt's chunk hashes."""
    data = _json_body(path, body) or {}
    key = data.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return (hashlib.blake2b(f"key|{data.get('model') or ''}\0{key}".encode(), digest_size=8).hexdigest(),)
    return chunk_hashes(_text(path, data), chunk_chars)


def prompt_text(path: str, body: bytes) -> str | None:
    """The text a request's KV cache starts with (chat messages flattened in order), keyed by the model or adapter
    it asks for; None for routes without a prompt or a body that is not a JSON object."""
    return _text(path, _json_body(path, body))


def _text(path: str, data: dict | None) -> str | None:
    if not data:
        return None
    if path == "/v1/chat/completions":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        text = "".join(f"<{m.get('role', '')}>{_content(m.get('content'))}" for m in messages if isinstance(m, dict))
    else:
        text = _prompt(data.get("prompt"))
    return f"{data.get('model') or ''}\0{text}" if text else None


def _content(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _prompt(prompt) -> str:
    """A string, token ids, or a batch of either (routed by its first prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def chunk_hashes(text: str | None, chunk_chars: int) -> tuple[str, ...]:
    """Chained hashes of the text's whole chunks (a partial last chunk holds no full page: not counted)."""
    if not text:
        return ()
    out, parent = [], ""
    for start in range(0, min(len(text) // chunk_chars, MAX_CHUNKS) * chunk_chars, chunk_chars):
        parent = hashlib.blake2b(f"{parent}|{text[start:start + chunk_chars]}".encode(), digest_size=8).hexdigest()
        out.append(parent)
    return tuple(out)


def rendezvous(key: str, replicas: list[str]) -> str:
    """The replica `key` belongs to: the same answer in every process, and few keys move when replicas change."""
    return max(replicas, key=lambda r: hashlib.blake2b(f"{key}|{r}".encode(), digest_size=8).digest())


class AffinityTable:
    """chunk hash -> the replica that last took it, least recently used entries dropped past `capacity`."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def deepest_owner(self, chunks: tuple[str, ...], live: set[str]) -> tuple[str | None, int]:
        """(replica, chunks matched) for the deepest chunk a live replica holds; (None, 0) when none does."""
        for depth in range(len(chunks), 0, -1):
            owner = self._owner.get(chunks[depth - 1])
            if owner in live:
                return owner, depth
        return None, 0

    def record(self, chunks: tuple[str, ...], replica: str) -> None:
        for c in chunks:
            self._owner[c] = replica
            self._owner.move_to_end(c)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replicas: set[str]) -> None:
        for c in [c for c, r in self._owner.items() if r in replicas]:
            del self._owner[c]


def choose(chunks: tuple[str, ...], loads: dict[str, int], table: AffinityTable,
           max_load_gap: int, rng: random.Random | None = None) -> tuple[list[list[str]], str]:
    """Ranked replica ids (try the first group first) and the decision: affinity (a replica holds the prefix),
    new_prefix (its hashed owner), overloaded (the owner is too busy: least busy instead) or no_prefix. Replicas
    equally busy are ranked at random, so idle replicas share the requests that have no prefix to follow."""
    by_load = sorted((rng or random).sample(sorted(loads), len(loads)), key=loads.__getitem__)
    if not chunks or not loads:
        return [by_load[:2]], "no_prefix"
    owner, _ = table.deepest_owner(chunks, set(loads))
    decision = "affinity" if owner is not None else "new_prefix"
    owner = owner or rendezvous(chunks[0], list(loads))
    if loads[owner] - loads[by_load[0]] > max_load_gap:
        return [by_load[:2]], "overloaded"
    return [[owner], [r for r in by_load if r != owner]], decision
