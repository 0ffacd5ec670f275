"""Pages of the KV cache: a free list, reference counts, and a prefix cache keyed by
hash(parent page hash, page tokens, adapter key: the adapter's digest).

Page 0 is reserved and never handed out: it stays zero, and padded attention gathers read it.
Freed pages that hold a cached prefix stay findable until the page is handed out again (least recently freed first);
pages without a cached prefix are reused before them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from mlc.engine.sequence import Sequence

NULL_PAGE = 0


@dataclass
class PageCopy:
    """Copy the first `num_entries` slots of page `src` into page `dst` before the step runs (copy-on-write)."""

    src: int
    dst: int
    num_entries: int


def page_hash(parent: int | None, tokens: tuple[int, ...], adapter_id: int) -> int:
    return hash((parent, tokens, adapter_id))


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (one is reserved)")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_pages
        self.free_plain: deque[int] = deque(range(1, num_pages))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.page_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> (hash, tokens)
        self.hash_to_page: dict[int, int] = {}
        self.prefix_queries = 0  # full prompt pages looked up
        self.prefix_hits = 0  # of which found in the cache
        self.spare_last_hit = False  # a hit gives back its last page (the model has an MTP layer: models/mtp.py)

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.usable_pages

    def pages_for(self, num_entries: int) -> int:
        return (num_entries + self.page_size - 1) // self.page_size

    def _take_free(self) -> int:
        if self.free_plain:
            page = self.free_plain.popleft()
        else:
            page, _ = self.free_cached.popitem(last=False)
            self._forget(page)
        self.ref[page] = 1
        return page

    def _forget(self, page: int) -> None:
        key = self.page_key.pop(page, None)
        if key is not None and self.hash_to_page.get(key[0]) == page:
            del self.hash_to_page[key[0]]

    def _retain(self, page: int) -> None:
        if self.ref[page] == 0:
            self.free_cached.pop(page, None)
        self.ref[page] += 1

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached pages for the longest cached prefix of a sequence that holds no pages yet.

        At least the last page's worth of tokens is always recomputed, so a cached page is never written again;
        with `spare_last_hit` (a model with an MTP layer, models/mtp.py) the last page found is recomputed too.
        Returns the number of tokens served from the cache.
        """
        if not self.enable_prefix_caching or seq.page_table or seq.params.prompt_logprobs:
            return 0  # a prompt-logprobs request scores every token, so it computes them all
        tokens = seq.all_ids
        usable = (len(tokens) - 1) // self.page_size
        parent = None
        found: list[tuple[int, int]] = []  # (page, hash)
        for i in range(usable):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            h = page_hash(parent, chunk, seq.adapter_key or seq.adapter_id)
            self.prefix_queries += 1
            page = self.hash_to_page.get(h)
            if page is None or self.page_key[page][1] != chunk:
                self.prefix_queries += usable - i - 1
                break
            self.prefix_hits += 1
            found.append((page, h))
            parent = h
        if self.spare_last_hit and found:  # the last page's last MTP slot depends on the token after it
            found.pop()
            self.prefix_hits -= 1
        hashes = [h for _, h in found]
        for page, _ in found:
            self._retain(page)
            seq.page_table.append(page)
        seq.page_hashes = hashes
        hit = len(hashes) * self.page_size
        seq.num_cached = seq.num_cache_entries = hit
        if not seq.output_ids:
            seq.num_prefix_hit = hit
        return hit

    def can_grow(self, seq: Sequence, num_entries: int) -> bool:
        need = self.pages_for(num_entries) - len(seq.page_table)
        return need + self._cow_needed(seq, num_entries) <= self.num_free_pages

    def _cow_needed(self, seq: Sequence, num_entries: int) -> int:
        if not seq.page_table or seq.num_cache_entries % self.page_size == 0:
            return 0
        return int(num_entries > seq.num_cache_entries and self.ref[seq.page_table[-1]] > 1)

    def grow(self, seq: Sequence, num_entries: int) -> list[PageCopy]:
        """Give `seq` pages for `num_entries` cache entries; a shared, partly filled last page is copied first."""
        copies: list[PageCopy] = []
        if self._cow_needed(seq, num_entries):
            old = seq.page_table[-1]
            new = self._take_free()
            copies.append(PageCopy(old, new, seq.num_cache_entries % self.page_size))
            self._release(old)
            seq.page_table[-1] = new
        while len(seq.page_table) < self.pages_for(num_entries):
            seq.page_table.append(self._take_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's pages (the `n` samples of one prompt)."""
        for page in parent.page_table:
            self._retain(page)
        child.page_table = list(parent.page_table)
        child.page_hashes = list(parent.page_hashes)
        child.num_cached, child.num_cache_entries = parent.num_cached, parent.num_cache_entries
        child.kv_positions = parent.kv_positions

    def register_full_pages(self, seq: Sequence) -> None:
        """Make this sequence's newly filled pages findable by later prompts with the same prefix."""
        if not self.enable_prefix_caching or seq.num_cache_entries != seq.num_cached:
            return  # a compacted (sparse) cache no longer maps tokens to pages one to one
        hashes = seq.page_hashes
        tokens = seq.all_ids
        full = min(seq.num_cached // self.page_size, len(seq.page_table))
        while len(hashes) < full:
            i = len(hashes)
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            h = page_hash(hashes[-1] if hashes else None, chunk, seq.adapter_key or seq.adapter_id)
            hashes.append(h)
            page = seq.page_table[i]
            if h not in self.hash_to_page and page not in self.page_key:
                self.hash_to_page[h] = page
                self.page_key[page] = (h, chunk)

    def num_shared_pages(self, seq: Sequence) -> int:
        """Pages up to and including the last one another sequence also holds: these must not be rewritten."""
        return max((i + 1 for i, page in enumerate(seq.page_table) if self.ref[page] > 1), default=0)

    def unregister_from(self, seq: Sequence, first_page: int) -> None:
        """The sequence's pages from `first_page` on are about to be rewritten: they leave the prefix cache."""
        for page in seq.page_table[first_page:]:
            self._forget(page)
        del seq.page_hashes[first_page:]

    def shrink(self, seq: Sequence, num_entries: int) -> int:
        """After compaction the sequence holds `num_entries` entries: release the tail pages; returns how many."""
        keep = self.pages_for(num_entries)
        tail = seq.page_table[keep:]
        for page in reversed(tail):
            self._release(page)
        del seq.page_table[keep:]
        seq.num_cache_entries = num_entries
        return len(tail)

    def _release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if page in self.page_key:
                self.free_cached[page] = None
            else:
                self.free_plain.append(page)

    def reset(self) -> None:
        """Every page free and the prefix cache empty: the repair after a step left the accounting in doubt."""
        self.ref = [0] * self.num_pages
        self.free_plain = deque(range(1, self.num_pages))
        self.free_cached.clear()
        self.page_key.clear()
        self.hash_to_page.clear()

    def audit(self, holders: list[Sequence]) -> list[str]:
        """What is wrong with the accounting, given every sequence that holds pages (empty: consistent)."""
        problems: list[str] = []
        held = [0] * self.num_pages
        for seq in holders:
            for page in seq.page_table:
                if not 0 < page < self.num_pages:
                    problems.append(f"sequence {seq.seq_id} holds page {page}, outside 1..{self.num_pages - 1}")
                else:
                    held[page] += 1
            if self.pages_for(seq.num_cache_entries) > len(seq.page_table):
                problems.append(f"sequence {seq.seq_id} has {seq.num_cache_entries} entries in "
                                f"{len(seq.page_table)} pages")
        free = list(self.free_plain) + list(self.free_cached)
        if len(free) != len(set(free)):
            problems.append("a page is on the free lists twice")
        free_set = set(free)
        for page in range(1, self.num_pages):
            if held[page] != self.ref[page]:
                problems.append(f"page {page}: reference count {self.ref[page]}, held by {held[page]}")
            if (page in free_set) != (held[page] == 0):
                problems.append(f"page {page}: held by {held[page]} but {'' if page in free_set else 'not '}free")
        if NULL_PAGE in free_set or self.ref[NULL_PAGE]:
            problems.append("the null page was handed out")
        stale = [h for h, page in self.hash_to_page.items() if self.page_key.get(page, (None,))[0] != h]
        if stale:
            problems.append(f"{len(stale)} prefix-cache entries point at pages that hold other content")
        return problems

    def free(self, seq: Sequence) -> None:
        for page in reversed(seq.page_table):
            self._release(page)
        seq.page_table = []
        seq.page_hashes = []
        seq.num_cached = seq.num_cache_entries = 0
        seq.kv_positions = None
