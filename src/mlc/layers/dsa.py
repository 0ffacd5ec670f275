"""DeepSeek Sparse Attention (DSA) indexer, as GLM-5 uses it: picks each query's top-k keys of its context.

The indexer keeps its own per-token key (`index_k`, after LayerNorm and RoPE) in the paged cache. Selections are
returned per attention group as cache-order indices `[G, Q, k]`, or None when the whole context fits in
`index_topk` (every key is kept, so the causal mask alone decides). "shared" layers reuse a full layer's list.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlc.layers.attention import AttentionGroup, AttentionMetadata, GroupKind, gather_context, group_mask
from mlc.layers.kv_store import LayerCache
from mlc.layers.linear import Linear
from mlc.layers.rotary import apply_rope_deinterleave

Selection = list[torch.Tensor | None]  # one entry per AttentionMetadata group


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, in the activation dtype (the indexer's k_norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class DsaIndexer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        # fp32 whatever the model dtype: bf16 head weights flip near-ties (transformers upcasts it only under fp16)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        self.weights_proj.float()

    def _rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE (C) on the first `rope_dim` dims of `x [T, H, D]` (the main query puts its rope slice last)."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope_deinterleave(rot, cos, sin), rest), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`[T, Di]`: what the cache holds as `index_k`."""
        return self._rope_first(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None,
        meta: AttentionMetadata,
    ) -> Selection:
        k = self.keys(x, cos, sin)
        if cache is not None and meta.slot_mapping is not None:
            cache["index_k"].write(meta.slot_mapping, k)
        masks = [group_mask(g, x.device) for g in meta.groups]
        if all(g.keys <= self.topk for g in meta.groups):
            return [None] * len(masks)
        q = self._rope_first(self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim), cos, sin)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        selection: Selection = []
        for g, mask in zip(meta.groups, masks):
            if g.keys <= self.topk:
                selection.append(None)
                continue
            kg = gather_context(g, cache["index_k"] if cache is not None else None, k, k.dtype)[:, : g.keys]
            scores = self.index_scores(self._rows(q, g), kg, self._rows(w, g), mask[:, 0, :, : g.keys])
            selection.append(self.top_keys(scores, g))
        return selection

    def top_keys(self, scores: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """`[G, Q, k]` indices of each query's top-k index scores, chosen as transformers chooses them.

        ReLU makes exact ties common, and which of the tied keys torch.topk returns depends on the row's width: a
        row is scored at its group's longest context, never the padded one (transformers scores a decode query
        over its context, a prompt row over the prompt). In a decode group, a shorter sequence whose k-th and
        (k+1)-th scores tie is chosen again over its own context. Decode keys come back in cache order, so the
        gathered context is summed in the order transformers' masked attention sums it."""
        top = scores.topk(self.topk, dim=-1)
        indices = top.indices
        if g.kind is GroupKind.DECODE and g.batch > 1:
            assert g.context is not None  # a decode group carries its context lengths
            tied = (scores >= top.values[..., -1:]).sum(-1)[:, 0] > self.topk
            for i in torch.nonzero(tied & (g.context < g.keys) & (g.context > self.topk)).flatten().tolist():
                indices[i] = scores[i, :, : int(g.context[i])].topk(self.topk, dim=-1).indices
        return indices.sort(dim=-1).values if g.kind is GroupKind.DECODE else indices

    @staticmethod
    def _rows(t: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        return t[g.tokens].view(g.batch, g.query_len, *t.shape[1:])

    def index_scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q `[G, Q, Hi, Di]`, k `[G, L, Di]`, head weights w `[G, Q, Hi]`, mask `[G, Q, L]` -> fp32 `[G, Q, L]`:
        `sum_h w_h * relu(q_h . k * Di^-0.5)`, -inf where the query may not attend."""
        scores = F.relu(torch.einsum("gqhd,gld->gqhl", q.float(), k.float()) * self.head_dim**-0.5)
        index = torch.einsum("gqh,gqhl->gql", w, scores)
        return index.masked_fill(~mask, float("-inf"))


def selection_mask(top: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Fold a group's top-k indices `[G, Q, k]` into its attend mask `[G, 1, Q, L]` (selected and causal)."""
    if top is None:
        return mask
    chosen = torch.zeros(mask.shape[0], mask.shape[2], mask.shape[3], dtype=torch.bool, device=mask.device)
    chosen.scatter_(-1, top, True)
    return mask & chosen[:, None]
