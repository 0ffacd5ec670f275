"""Multi-head latent attention (DeepSeek MLA, as GLM-5 uses it) over a latent paged cache, with DSA selection.

Per token the cache holds `latent = [c (kv_lora_rank, after kv_a_layernorm) | k_rot (qk_rope_head_dim, after
RoPE)]`; each step re-expands the gathered context with kv_b_proj into per-head k_nope and v, which is the same
math as transformers' expanded K/V cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mlc.distributed.state import reduce_from_tp
from mlc.layers.attention import AttentionGroup, AttentionMetadata, GroupKind, gather_context, group_mask
from mlc.layers.dsa import DsaIndexer, Selection, selection_mask
from mlc.layers.kv_store import LayerCache
from mlc.layers.linear import Linear, split_evenly
from mlc.layers.norm import RMSNorm
from mlc.layers.rotary import apply_rope_deinterleave, rope_parameters


def mla_scale(cfg) -> float:
    """`qk_head_dim^-0.5`, times yarn's mscale squared for a scaled rope with `mscale_all_dim`."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    mscale_all_dim = params.get("mscale_all_dim", 0) if params["rope_type"] != "default" else 0
    factor = params.get("factor", 1.0)
    if mscale_all_dim and factor > 1:
        scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg, with_indexer: bool):
        super().__init__()
        self.num_heads = split_evenly(cfg.num_attention_heads, "number of attention heads")  # this rank's
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        bias = bool(getattr(cfg, "attention_bias", False))
        qk = self.nope + self.rope
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)
        heads = cfg.num_attention_heads  # the latent projections stay whole on every rank; per-head ones split
        self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk, parallel="col", what="number of attention heads")
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.nope + self.v_dim), parallel="col",
                                what="number of attention heads")
        self.o_proj = Linear(heads * self.v_dim, cfg.hidden_size, bias=bias, parallel="row",
                             what="number of attention heads")
        self.indexer = DsaIndexer(cfg) if with_indexer else None
        self.scale = mla_scale(cfg)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`[T, kv_lora_rank + rope]`: what the cache holds per token."""
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_rot = apply_rope_deinterleave(k_rot[:, None], cos, sin)[:, 0]
        return torch.cat((self.kv_a_layernorm(c), k_rot), dim=-1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent `[G, L, kv_lora_rank + rope]` -> K `[G, L, H, nope + rope]`, V `[G, L, H, v]`."""
        c, k_rot = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(*c.shape[:2], self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot[:, :, None].expand(-1, -1, self.num_heads, -1)), dim=-1)
        return k, v

    @staticmethod
    def _context(g: AttentionGroup, top, store, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's latent context `[G, L, .]` and attend mask `[G, 1, Q, L]`. Decode queries with a selection
        gather only their top-k slots (what makes DSA cheap at long context); prefill queries each select
        different keys, so they expand the whole context and mask it."""
        mask = group_mask(g, latent.device)
        if top is not None and g.kind is GroupKind.DECODE:
            assert g.gather_slots is not None  # a decode group carries its context's cache slots
            pick = top[:, 0]
            return store.gather(g.gather_slots.gather(1, pick), latent.dtype), mask.gather(-1, pick[:, None, None])
        return gather_context(g, store, latent, latent.dtype), selection_mask(top, mask)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None,
        meta: AttentionMetadata,
        prev_selection: Selection | None,
    ) -> tuple[torch.Tensor, Selection]:
        t = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rot = self.q_b_proj(q_resid).view(t, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, apply_rope_deinterleave(q_rot, cos, sin)), dim=-1)
        latent = self.latent(x, cos, sin)
        if cache is not None and meta.slot_mapping is not None:
            cache["latent"].write(meta.slot_mapping, latent)
        if self.indexer is not None:
            selection = self.indexer(x, q_resid, cos, sin, cache, meta)
        elif prev_selection is None:
            raise ValueError("a 'shared' DSA layer needs an earlier 'full' layer's selection; layer 0 must be full")
        else:
            selection = prev_selection
        out = q.new_empty(t, self.num_heads, self.v_dim)
        store = cache["latent"] if cache is not None else None
        for g, top in zip(meta.groups, selection):
            context, mask = self._context(g, top, store, latent)
            k, v = self.expand(context)
            qg = q[g.tokens].view(g.batch, g.query_len, self.num_heads, -1)
            og = F.scaled_dot_product_attention(
                qg.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
            )
            out[g.tokens] = og.transpose(1, 2).reshape(-1, self.num_heads, self.v_dim)
        return reduce_from_tp(self.o_proj(out.reshape(t, -1))), selection
