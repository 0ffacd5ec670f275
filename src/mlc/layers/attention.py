"""Attention metadata for a flat batch of sequences, and the paged attention backend (torch SDPA).

A step's tokens are flat (`[T, ...]`), sequence after sequence. Each sequence contributes `query_len` new tokens
and, after this step, holds `context_len` cache entries (the new ones last). Sequences are grouped once per
step, and every layer reuses the groups:

* fresh: nothing cached before this step, keys are the new tokens themselves (causal SDPA, no gather);
* decode: one new token and earlier context; all such sequences run as one padded, masked SDPA;
* chunk: several new tokens after earlier context (chunked prefill, prefix-cache hit); one SDPA each.

Masks use cache order, not positions, so a compacted (sparse) cache stays causal while rotary uses positions.
This module is the one place a CUDA/NPU paged-attention kernel would replace.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.kv_store import LayerCache, PagedTensor

# Decode groups attend over a key length padded to a multiple of this, whatever their batch: SDPA's vectorized
# softmax then sums the same lanes in the same order for a sequence alone or beside longer ones (padding adds
# exact zeros), so a request's output does not depend on its batch (bf16 on the CPU, tested bit for bit).
KEY_QUANTUM = 32


class GroupKind(str, enum.Enum):
    """How a group of sequences attends this step (see the module docstring)."""

    FRESH = "fresh"
    DECODE = "decode"
    CHUNK = "chunk"


@dataclass
class AttentionGroup:
    kind: GroupKind
    tokens: torch.Tensor | slice  # flat query rows of this group
    batch: int
    query_len: int
    seq_ids: list[int]  # indices into the step's sequences
    gather_slots: torch.Tensor | None = None  # [G, L] cache slots of each sequence's context
    mask: torch.Tensor | None = None  # [G, 1, query_len, L] bool, True = may attend
    keys: int = 0  # the longest context of the group (L, before a decode group's padding to KEY_QUANTUM)
    pages: torch.Tensor | None = None  # decode: [G, P] page table of each sequence (the C++ kernel reads in place)
    context: torch.Tensor | None = None  # decode: [G] context length of each sequence
    page_size: int = 0


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor | None  # [T] cache slot of each new token; None on the dense path
    groups: list[AttentionGroup] = field(default_factory=list)
    query_start: list[int] = field(default_factory=list)
    # every sequence decodes one generated token in place: all of them as one decode group in step order (the C++
    # kernel computes each sequence alone, so one call over all gives each group's results); None otherwise
    in_place_decode: AttentionGroup | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def _slots_for(page_table: torch.Tensor, start: int, stop: int, page_size: int) -> torch.Tensor:
    idx = torch.arange(start, stop, device=page_table.device)
    return page_table[idx // page_size] * page_size + idx % page_size


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    page_tables: list[list[int]] | None = None,
    page_size: int = 16,
    device: torch.device | str = "cpu",
    generating: list[bool] | None = None,
) -> AttentionMetadata:
    """Metadata for one step. `page_tables=None` is the dense path: every sequence must be fresh.

    `generating[i]`: sequence i's new token follows its whole prompt. Only such decode rows may take the C++
    kernel; a prompt's last token after a prefix-cache hit stays on SDPA, so a prompt's logits are the same
    whether or not its prefix was cached (None: every decode row may)."""
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens differ in length")
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(list(query_lens), list(context_lens), None, [], starts[:-1])
    tables = None
    if page_tables is not None:
        width = max((len(t) for t in page_tables), default=1) or 1
        padded = [list(t) + [0] * (width - len(t)) for t in page_tables]
        tables = torch.tensor(padded, dtype=torch.long, device=device).view(len(page_tables), width)
        meta.slot_mapping = torch.cat(
            [_slots_for(tables[i], c - q, c, page_size) for i, (q, c) in enumerate(zip(query_lens, context_lens))]
        ) if query_lens else torch.empty(0, dtype=torch.long, device=device)
    decode: list[int] = []
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        if q == c:
            meta.groups.append(AttentionGroup(GroupKind.FRESH, slice(starts[i], starts[i] + q), 1, q, [i], keys=q))
        elif tables is None:
            raise ValueError("the dense path (no cache) needs every sequence to be fresh (context_len == query_len)")
        elif q == 1:
            decode.append(i)
        else:
            slots = _slots_for(tables[i], 0, c, page_size)[None]
            key_idx = torch.arange(c, device=device)
            query_idx = torch.arange(c - q, c, device=device)
            mask = (key_idx[None, :] <= query_idx[:, None])[None, None]
            meta.groups.append(AttentionGroup(GroupKind.CHUNK, slice(starts[i], starts[i] + q), 1, q, [i], slots, mask,
                                              keys=c))
    for in_place in (True, False):
        chosen = [i for i in decode if (generating is None or generating[i]) == in_place]
        for bucket in _length_buckets(chosen, context_lens):
            meta.groups.append(_decode_group(bucket, starts, context_lens, tables, page_size, device, in_place))
    if decode and len(decode) == len(query_lens) and all(g.pages is not None for g in meta.groups):
        meta.in_place_decode = meta.groups[0] if len(meta.groups) == 1 else AttentionGroup(
            GroupKind.DECODE, slice(0, len(decode)), len(decode), 1, decode, pages=tables,
            context=torch.tensor(context_lens, device=device), page_size=page_size)
    return meta


def _length_buckets(ids: list[int], context_lens: list[int], spread: float = 2.0) -> list[list[int]]:
    """Decode sequences grouped by context length so that padding to a group's longest stays under `spread`x:
    one long document no longer makes every short chat in the batch gather and attend over its length."""
    buckets: list[list[int]] = []
    for i in sorted(ids, key=lambda i: context_lens[i]):
        if buckets and context_lens[i] <= spread * context_lens[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    for b in buckets:
        b.sort()  # batch order inside a group keeps the token rows contiguous where they were
    return buckets


def _decode_group(ids, starts, context_lens, tables, page_size, device, in_place: bool) -> AttentionGroup:
    ctx = torch.tensor([context_lens[i] for i in ids], device=device)
    longest = max(context_lens[i] for i in ids)
    padded = -(-longest // KEY_QUANTUM) * KEY_QUANTUM
    num_pages = -(-padded // page_size)
    pages = tables[ids][:, :num_pages]
    if pages.shape[1] < num_pages:  # the padding reaches past every page table: null pages
        pages = F.pad(pages, (0, num_pages - pages.shape[1]))
    slots = (pages[:, :, None] * page_size + torch.arange(page_size, device=device)).flatten(1)[:, :padded]
    valid = torch.arange(padded, device=device)[None, :] < ctx[:, None]
    slots = slots.masked_fill(~valid, 0)  # padding reads slot 0 (the reserved null page), never unwritten memory
    mask = valid[:, None, None, :]
    rows = [starts[i] for i in ids]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    tokens = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=device)
    return AttentionGroup(GroupKind.DECODE, tokens, len(ids), 1, list(ids), slots, mask, keys=longest,
                          pages=tables[ids] if in_place else None, context=ctx, page_size=page_size)


def gather_context(g: AttentionGroup, store, fresh: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One group's context `[G, L, ...]` in cache order: the new tokens' own values for a fresh group,
    else the cached entries at `g.gather_slots` (`store` is that layer's PagedTensor)."""
    if g.gather_slots is None:
        return fresh[g.tokens][None]
    return store.gather(g.gather_slots, dtype)


def group_mask(g: AttentionGroup, device: torch.device | str) -> torch.Tensor:
    """`[G, 1, query_len, L]` bool, True = may attend; fresh groups get their causal mask built here."""
    if g.mask is not None:
        return g.mask
    idx = torch.arange(g.query_len, device=device)
    return (idx[None, :] <= idx[:, None])[None, None]


def _sdpa(q, k, v, mask, scale, causal):
    """q `[G, Q, H, D]`, k/v `[G, L, KV, D]` -> `[G, Q, H, Dv]`."""
    groups = q.shape[2] // k.shape[2]
    if q.shape[1] == 1 and groups > 1:
        # one query per sequence: its heads sharing a kv head become that head's query rows, so no K/V copy
        g, _, h, d = q.shape
        out = F.scaled_dot_product_attention(
            q.view(g, k.shape[2], groups, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
        )
        return out.reshape(g, 1, h, v.shape[-1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1,
    )
    return out.transpose(1, 2)


def _decode_in_place(g: AttentionGroup, q, cache: LayerCache, scale: float) -> torch.Tensor | None:
    """A decode group through the C++ kernel (`layers/cpu_kernels.py`), or None where it does not apply: not
    built, a non-CPU device, a quantized KV store, or a cache dtype other than the compute dtype."""
    ks, vs = cache["k"], cache["v"]
    if type(ks) is not PagedTensor or type(vs) is not PagedTensor or q.device.type != "cpu":
        return None
    if not (ks.data.dtype == vs.data.dtype == q.dtype):
        return None
    kernel = cpu_op("decode_attention")
    if kernel is None:
        return None
    out = kernel(q[g.tokens], ks.data, vs.data, g.pages, g.context, g.page_size, scale)
    return out.view(g.batch, 1, q.shape[1], vs.data.shape[-1])


def _group_attention(g: AttentionGroup, q, k, v, cache: LayerCache | None, scale: float) -> torch.Tensor:
    if g.kind is GroupKind.DECODE and g.pages is not None and cache is not None:
        out = _decode_in_place(g, q, cache, scale)
        if out is not None:
            return out
    qg = q[g.tokens].view(g.batch, g.query_len, *q.shape[1:])
    if g.gather_slots is None:
        return _sdpa(qg, k[g.tokens][None], v[g.tokens][None], None, scale, causal=g.query_len > 1)
    assert cache is not None  # cached context (page tables) comes with the layer's cache
    kg = gather_context(g, cache["k"], k, q.dtype)
    vg = gather_context(g, cache["v"], v, q.dtype)
    return _sdpa(qg, kg, vg, g.mask, scale, causal=False)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache | None,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q `[T, H, D]`, k `[T, KV, D]`, v `[T, KV, Dv]` for the new tokens; returns `[T, H, Dv]`."""
    if cache is not None and meta.slot_mapping is not None:
        cache["k"].write(meta.slot_mapping, k)
        cache["v"].write(meta.slot_mapping, v)
    shape = (q.shape[0], q.shape[1], v.shape[-1])
    if len(meta.groups) == 1 and meta.groups[0].batch * meta.groups[0].query_len == q.shape[0]:
        return _group_attention(meta.groups[0], q, k, v, cache, scale).reshape(shape)
    out = q.new_empty(shape)
    for g in meta.groups:
        out[g.tokens] = _group_attention(g, q, k, v, cache, scale).reshape(-1, *shape[1:])
    return out
