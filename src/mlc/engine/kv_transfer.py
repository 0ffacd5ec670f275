"""Prefill/decode disaggregation, the engine's half: export a prompt's KV pages from a prefill engine (P) and import
them into a decode engine (D), which then continues the request as if it had prefilled it.

P runs the prompt with one output token, then keeps the sequence's pages under a lease (a holder of its own in the
page manager, so the pages cannot be reused) and returns a `KVHandle`. The lease ends exactly once: when D says it
pulled the pages, on an abort, or when it expires. D reserves pages for the prompt (reusing those its own prefix cache
already holds), receives the others' bytes (`pack`/`unpack`: every KV group of every layer, quantized stores' codes and
scales alike, as one flat byte buffer) and hands them to `finish_import`; no bytes (a failed or expired transfer) make
D recompute the prompt itself. The transport (`engine/kv_transport.py`) and the side channel (the server's routes) sit
outside this module; everything here runs on the engine's own thread.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mlc.engine.kv_cache import KVCache
from mlc.engine.page_manager import PageManager
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import FinishReason, Sequence
from mlc.errors import InvalidRequestError


@dataclass
class KVHandle:
    """What P returns after a prefill: enough for D to pull the pages and go on."""

    request_id: str
    num_tokens: int  # prompt tokens whose KV the pages hold
    first_token: int  # the token P sampled after the prompt
    pages: dict[str, list[int]]  # KV group -> P's page ids (every group is indexed by the one page table)
    kv_format: str  # fingerprint of the cache layout; D refuses (and recomputes) on a mismatch
    page_size: int
    address: str = ""  # P's side channel (its base URL), filled by the router
    store: str = ""  # P's gloo store (host:port), filled by P's server
    expires_in: float = 0.0  # seconds the lease had left when the handle was made
    rng_state: str = ""  # a seeded request's generator after its first draw (base64), so D draws on from there

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandle:
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except TypeError as e:
            raise InvalidRequestError(f"malformed KV handle ({e}); pass the handle the prefill returned unchanged",
                                      field="kv_handle") from e

    @property
    def page_ids(self) -> list[int]:
        return next(iter(self.pages.values()), [])


@dataclass
class Lease:
    holder: Sequence  # owns a reference on each page, like a sequence would
    deadline: float


@dataclass
class PendingImport:
    seq: Sequence
    handle: KVHandle
    hit_pages: int  # pages D's own prefix cache served: not transferred
    started: float = field(default_factory=time.monotonic)
    void: bool = False  # the engine rebuilt its cache meanwhile: the pages are gone, recompute

    @property
    def src_pages(self) -> list[int]:
        return self.handle.page_ids[self.hit_pages:]

    @property
    def dst_pages(self) -> list[int]:
        return self.seq.page_table[self.hit_pages:]


@dataclass
class TransferStats:
    leases_made: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    imports: int = 0
    imports_recomputed: int = 0
    pages_skipped: int = 0  # pages a prefix-cache hit on D did not transfer
    bytes_received: int = 0
    bytes_sent: int = 0
    transfer_seconds: float = 0.0  # D: from reservation to the pages in place (waiting for KV included)


def stores(cache: KVCache) -> list[torch.Tensor]:
    """Every tensor of the cache, in a fixed order: per layer, per KV group, its data and (quantized) its scales."""
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        for name in sorted(layer):
            out.append(layer[name].data)
            params = getattr(layer[name], "params", None)
            if params is not None:
                out.append(params)
    return out


def kv_format(cache: KVCache) -> str:
    """A fingerprint of the cache's layout: two engines can exchange pages only when theirs are equal."""
    desc = [f"page_size={cache.page_size}"]
    for i, layer in enumerate(cache.layers):
        for name in sorted(layer):
            desc.append(f"{i}.{name}:{tuple(layer[name].shape)}:{cache.dtype}")
    for t in stores(cache):
        desc.append(f"{tuple(t.shape[1:])}:{t.dtype}")
    return hashlib.sha256("|".join(desc).encode()).hexdigest()[:16]


def _paged(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """A store as [pages, bytes of one page]: whole pages move as single rows."""
    return t.view(t.shape[0] // page_size, -1)


def pack_bytes(cache: KVCache, num_pages: int) -> int:
    """Bytes `pack` makes for `num_pages` pages."""
    return sum(t[0].numel() * t.element_size() for t in stores(cache)) * num_pages * cache.page_size


@torch.no_grad()
def pack(cache: KVCache, pages: list[int]) -> torch.Tensor:
    """The pages' entries in every store as one flat uint8 CPU tensor."""
    if not pages:
        return torch.empty(0, dtype=torch.uint8)
    ts = stores(cache)
    idx = torch.tensor(pages, dtype=torch.long, device=ts[0].device)
    return torch.cat([_paged(t, cache.page_size).index_select(0, idx).view(torch.uint8).reshape(-1).cpu()
                      for t in ts])


@torch.no_grad()
def unpack(cache: KVCache, pages: list[int], buf: torch.Tensor) -> None:
    """Write a `pack`ed buffer into these pages (its length must match)."""
    if not pages:
        return
    want = pack_bytes(cache, len(pages))
    if buf.numel() != want:
        raise ValueError(f"KV buffer holds {buf.numel()} bytes, {want} expected for {len(pages)} pages")
    ts = stores(cache)
    idx = torch.tensor(pages, dtype=torch.long, device=ts[0].device)
    offset = 0
    for t in ts:
        paged = _paged(t, cache.page_size)
        n = len(pages) * paged.shape[1] * t.element_size()
        paged.index_copy_(0, idx, buf[offset:offset + n].to(t.device).view(t.dtype).view(len(pages), -1))
        offset += n


class KVConnector:
    """Leases (P) and pending imports (D) of one engine."""

    def __init__(self, pages: PageManager, cache: KVCache, lease_timeout: float = 30.0,
                 exportable: bool = True) -> None:
        self.pages, self.cache, self.lease_timeout = pages, cache, lease_timeout
        self.exportable = exportable  # False under tensor parallelism: this process holds only its ranks' heads
        self.format = kv_format(cache)
        self.holding: set[str] = set()  # P: requests whose pages outlive them
        self.leases: dict[str, Lease] = {}
        self.handles: dict[str, KVHandle] = {}
        self.pending: dict[str, PendingImport] = {}
        self.stats = TransferStats()

    # P ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def prefill_params(params: SamplingParams) -> SamplingParams:
        """The request's own sampling rules for its first token, and no more."""
        first = copy.copy(params)
        first.max_new_tokens, first.min_new_tokens, first.n = 1, min(params.min_new_tokens, 1), 1
        return first

    def on_finish(self, seq: Sequence) -> None:
        """The scheduler is about to free a finished sequence's pages: a held prefill keeps them under a lease."""
        if seq.request_id not in self.holding:
            return
        self.holding.discard(seq.request_id)
        prompt = len(seq.prompt_ids)
        if seq.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or not seq.output_ids \
                or seq.num_cached < prompt or seq.num_cache_entries != seq.num_cached:
            return  # aborted, failed, or a compacted (sparse) cache: nothing to hand over
        holder = Sequence(seq.request_id, seq.prompt_ids, seq.params)
        self.pages.fork(seq, holder)
        self.pages.shrink(holder, prompt)  # just the prompt's pages
        self.leases[seq.request_id] = Lease(holder, time.monotonic() + self.lease_timeout)
        rng = base64.b64encode(seq.generator.get_state().numpy().tobytes()).decode() if seq.generator else ""
        self.handles[seq.request_id] = KVHandle(
            seq.request_id, prompt, seq.output_ids[0], {g: list(holder.page_table) for g in self.groups()},
            self.format, self.cache.page_size, expires_in=self.lease_timeout, rng_state=rng)
        self.stats.leases_made += 1

    def groups(self) -> list[str]:
        """Every KV group some layer stores (GLM-5: `latent` everywhere, `index_k` on its indexer layers)."""
        return sorted({name for layer in self.cache.layers for name in layer})

    def handle(self, request_id: str) -> KVHandle | None:
        return self.handles.get(request_id)

    def export(self, request_id: str, skip_pages: int = 0) -> torch.Tensor:
        """The leased pages' bytes from `skip_pages` on; KeyError when the lease is gone (expired or released)."""
        lease = self.leases[request_id]
        buf = pack(self.cache, lease.holder.page_table[skip_pages:])
        self.stats.bytes_sent += buf.numel()
        return buf

    def release(self, request_id: str, expired: bool = False) -> bool:
        """End a lease (freeing its pages exactly once); False when there was none."""
        self.holding.discard(request_id)
        self.handles.pop(request_id, None)
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.pages.free(lease.holder)
        if expired:
            self.stats.leases_expired += 1
        else:
            self.stats.leases_released += 1
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        gone = [rid for rid, lease in self.leases.items() if lease.deadline <= now]
        for rid in gone:
            self.release(rid, expired=True)
        return gone

    # D ------------------------------------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, handle: KVHandle) -> PendingImport | None:
        """Pages for the prompt, the prefix cache's first: None when the handle does not fit this cache or the pages
        are not free (the caller then recomputes)."""
        n = len(seq.prompt_ids)
        if handle.kv_format != self.format or handle.num_tokens != n or len(handle.page_ids) != self.pages.pages_for(n):
            return None
        self.pages.match_prefix(seq)
        if not self.pages.can_grow(seq, n):
            self.pages.free(seq)
            return None
        self.pages.grow(seq, n)  # a prefix hit is whole pages, so nothing is copied
        hit = len(seq.page_hashes)
        self.stats.pages_skipped += hit
        pending = PendingImport(seq, handle, hit)
        self.pending[seq.request_id] = pending
        return pending

    def complete(self, request_id: str, buf: torch.Tensor | None) -> PendingImport | None:
        """Put received bytes in place; returns the import, its sequence's KV now covering the prompt (or, with no
        usable bytes, holding no pages so that it is recomputed). None when it was aborted meanwhile."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return None
        seq = pending.seq
        ok = buf is not None and not pending.void
        if buf is not None and ok:
            try:
                unpack(self.cache, pending.dst_pages, buf)
            except (ValueError, RuntimeError):
                ok = False
        self.stats.transfer_seconds += time.monotonic() - pending.started
        if ok:
            assert buf is not None
            self.stats.imports += 1
            self.stats.bytes_received += buf.numel()
            seq.num_cached = seq.num_cache_entries = len(seq.prompt_ids)
            self.pages.register_full_pages(seq)
            if seq.generator is not None and pending.handle.rng_state:
                state = bytearray(base64.b64decode(pending.handle.rng_state))
                seq.generator.set_state(torch.frombuffer(state, dtype=torch.uint8))
        else:
            self.stats.imports_recomputed += 1
            self.pages.free(seq)
        return pending

    # both ---------------------------------------------------------------------------------------------------------
    def holders(self) -> list[Sequence]:
        """Page holders outside the scheduler, for the page audit."""
        return [lease.holder for lease in self.leases.values()] + [p.seq for p in self.pending.values()]

    def reset(self) -> None:
        """The engine rebuilt its cache (every page free): leases are gone, pending imports will be recomputed."""
        self.leases.clear()
        self.handles.clear()
        for p in self.pending.values():
            p.void = True
            p.seq.page_table, p.seq.page_hashes = [], []
            p.seq.num_cached = p.seq.num_cache_entries = 0
