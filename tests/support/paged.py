"""Drive a model through the paged cache the way the engine does, without the scheduler."""

from __future__ import annotations

import torch

from mlc.engine.kv_cache import KVCache
from mlc.layers.attention import build_attention_metadata


class PagedRunner:
    """Gives each sequence its own consecutive pages and runs steps of (sequence -> new tokens)."""

    def __init__(self, model, max_len: int = 256, num_seqs: int = 4, page_size: int = 4):
        self.model, self.page_size = model, page_size
        pages_per_seq = (max_len + page_size - 1) // page_size
        self.cache = KVCache(model.kv_cache_spec(), pages_per_seq * num_seqs, page_size, model.dtype, model.device)
        # interleave page ids across sequences so tables are not contiguous ranges
        self.tables = [list(range(s, pages_per_seq * num_seqs, num_seqs)) for s in range(num_seqs)]
        self.lens = [0] * num_seqs

    @torch.inference_mode()
    def step(self, work: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed new tokens to sequences; returns fp32 logits `[n_new, vocab]` per sequence."""
        ids = list(work)
        qlens = [len(work[i]) for i in ids]
        ctx = [self.lens[i] + q for i, q in zip(ids, qlens)]
        meta = build_attention_metadata(qlens, ctx, [self.tables[i] for i in ids], self.page_size)
        tokens = torch.tensor([t for i in ids for t in work[i]], dtype=torch.long)
        positions = torch.cat([torch.arange(self.lens[i], c) for i, c in zip(ids, ctx)])
        hidden = self.model(tokens, positions, meta, self.cache.layers)
        logits = self.model.compute_logits(hidden).split(qlens)
        for i, c in zip(ids, ctx):
            self.lens[i] = c
        return dict(zip(ids, logits))


def incremental_logits(model, seqs: list[list[int]], prefill: int = 3, chunk: int = 1) -> list[torch.Tensor]:
    """Prefill the first `prefill` tokens of every sequence together, then feed `chunk` tokens per step to all
    sequences at once (mixing decode and chunked prefill); returns logits for every position."""
    runner = PagedRunner(model, max_len=max(len(s) for s in seqs) + 8, num_seqs=len(seqs))
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    pos = [0] * len(seqs)
    first = True
    while any(p < len(s) for p, s in zip(pos, seqs)):
        work = {}
        for i, s in enumerate(seqs):
            n = prefill if first else (chunk if i % 2 == 0 else 1)
            if pos[i] < len(s):
                work[i] = s[pos[i] : pos[i] + n]
        first = False
        for i, lg in runner.step(work).items():
            outs[i].append(lg)
            pos[i] += len(work[i])
    return [torch.cat(o) for o in outs]
