"""Sparse KV: once a sequence has computed more than `min_context` tokens, it keeps its first `sink_tokens` entries,
its last `window` entries whole, and `ratio` of the older ones (strided by position), compacted within its own
pages; the pages freed at the tail go back to the free list, so more sequences fit.

The keep rule depends on a token's position alone (keep p if p < sinks or floor((p - sinks + 1) r) > floor((p -
sinks) r)), so thinning is idempotent: an entry kept once is kept by every later compaction, and old context stays
at `ratio` of its tokens instead of decaying to ratio^2, ratio^3. Keys are cached after rotary and masks follow
cache order, so the remaining entries keep their original positions.

Pages another sequence also holds (a prefix-cache hit still held by its first owner, the n samples of one prompt)
are left alone: compaction starts after the last shared page. Copying them first would give every sharer its own
compacted copy, which for n samples can cost more than the one shared full copy. A page only this sequence holds
but the prefix cache knows is dropped from the prefix cache before it is rewritten (`PageManager.unregister_from`).

Compaction runs between steps, and only when it drops at least `min_free_pages` pages' worth of entries (window /
8 pages, at least 1), so the window is moved once per that many pages rather than every token. A preempted
sequence loses its pages and is recomputed from its tokens like any other (compaction re-applies as its chunks
come in). Prefix-cache pages registered by a sparse sequence were all computed before its first compaction, and a
compacted sequence registers none, so a later request never inherits KV computed over thinned context.
"""

from __future__ import annotations

import logging
import math
from fractions import Fraction
from typing import Protocol

import torch

from mlc.config.engine_config import SparseKVConfig
from mlc.engine.page_manager import PageManager
from mlc.engine.sequence import Sequence

log = logging.getLogger("mlc.engine")

LOW_RATIO = 0.2  # the reference tutorial saw recall collapse below this


class SparseKVPolicy:
    """Which entries a sequence keeps; pure arithmetic on positions, no tensors of the cache."""

    def __init__(self, cfg: SparseKVConfig, page_size: int):
        self.cfg, self.page_size = cfg, page_size
        frac = Fraction(cfg.ratio).limit_denominator(1000)
        self.num, self.den = frac.numerator, frac.denominator
        self.min_free_pages = max(1, cfg.window // (8 * page_size))

    @property
    def active(self) -> bool:
        return self.num < self.den

    def keeps(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool mask: which of these token positions the rule keeps (sinks always)."""
        i = positions - self.cfg.sink_tokens
        return (i < 0) | ((i + 1) * self.num // self.den > i * self.num // self.den)

    def plan(self, positions: torch.Tensor, num_tokens: int, first_mutable: int) -> torch.Tensor | None:
        """Entry indices to keep, in order, for a sequence whose entries hold `positions`; None when compaction is
        not due (too short, or it would free less than `min_free_pages`). Entries before `first_mutable` stay."""
        if not self.active or num_tokens <= self.cfg.min_context:
            return None
        num_entries = len(positions)
        start = max(self.cfg.sink_tokens, first_mutable)
        stop = num_entries - self.cfg.window
        min_freed = self.min_free_pages * self.page_size
        if stop - start < min_freed:
            return None
        keep = self.keeps(positions[start:stop])
        if int((~keep).sum()) < min_freed:
            return None
        middle = start + torch.nonzero(keep)[:, 0]
        return torch.cat((torch.arange(start), middle, torch.arange(stop, num_entries)))

    def max_entries(self, num_tokens: int, chunk: int) -> int:
        """Most entries a sequence of `num_tokens` tokens can hold at once, fed `chunk` tokens a step (admission)."""
        if not self.active or num_tokens <= self.cfg.min_context:
            return num_tokens
        c = self.cfg
        old = max(0, num_tokens - c.sink_tokens - c.window)
        pending = math.ceil((self.min_free_pages * self.page_size + 1) / (1 - self.num / self.den)) + 1
        bound = c.sink_tokens + math.ceil(old * self.num / self.den) + 1 + c.window + pending + chunk
        return min(num_tokens, max(c.min_context + chunk, bound))


def entry_positions(seq: Sequence) -> torch.Tensor:
    """Token position of each cache entry: the layout of the last compaction, then the tokens computed since."""
    laid = seq.kv_positions if seq.kv_positions is not None else torch.empty(0, dtype=torch.long)
    since = seq.num_cache_entries - len(laid)
    return torch.cat((laid, torch.arange(seq.num_cached - since, seq.num_cached)))


class SlotMover(Protocol):
    """What moves cache entries: the KV cache itself, or the model runner (which reaches every tensor-parallel
    rank's shard)."""

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...


class SparseKV:
    """Applies the policy to running sequences: moves entries in every cache tensor and releases freed pages.
    `kv_cache` is what moves the entries (`move_slots`): the cache itself, or the engine's model runner, which reaches
    every tensor-parallel rank's shard. With `kv_cache=None` only the pages are accounted (capacity planning with
    the real allocator)."""

    def __init__(self, cfg: SparseKVConfig, page_manager: PageManager, kv_cache: SlotMover | None):
        self.policy = SparseKVPolicy(cfg, page_manager.page_size)
        self.pages, self.kv_cache = page_manager, kv_cache
        self.pages_freed = 0
        self.num_compactions = 0
        if cfg.ratio < LOW_RATIO:
            log.warning("sparse KV ratio %g keeps under %d%% of the older tokens; long-context recall may collapse "
                        "(0.25 is the reference setting)", cfg.ratio, int(LOW_RATIO * 100))

    @staticmethod
    def applies(seq: Sequence) -> bool:
        return not seq.params.full_kv

    def compact(self, seqs: list[Sequence]) -> int:
        """Compact every sequence that is due; returns the pages freed."""
        return sum(self.compact_one(s) for s in seqs if self.applies(s))

    def compact_one(self, seq: Sequence) -> int:
        ps = self.pages.page_size
        positions = entry_positions(seq)
        first_mutable = self.pages.num_shared_pages(seq) * ps
        kept = self.policy.plan(positions, seq.num_cached, first_mutable)
        if kept is None:
            return 0
        dst = torch.arange(len(kept))
        moved = kept != dst
        src, dst = kept[moved], dst[moved]
        self.pages.unregister_from(seq, int(dst[0]) // ps)
        if self.kv_cache is not None:
            table = torch.tensor(seq.page_table, dtype=torch.long)
            self.kv_cache.move_slots(table[src // ps] * ps + src % ps, table[dst // ps] * ps + dst % ps)
        seq.kv_positions = positions[kept]
        freed = self.pages.shrink(seq, len(kept))
        self.pages_freed += freed
        self.num_compactions += 1
        return freed
