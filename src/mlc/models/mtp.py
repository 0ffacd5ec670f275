"""Multi-token prediction (MTP, "NextN") layers: GLM-4.5/4.6/4.7's and GLM-5's own draft layer, as transformers'
`MtpLayer` runs it.

The checkpoints keep it as one more decoder layer after the trunk, `model.layers.{N}.*` (N = num_hidden_layers),
with four extra tensors: `eh_proj` [hidden, 2 * hidden], `enorm`, `hnorm` and `shared_head.norm`; the embedding and
the head are the trunk's (`embed_tokens` / `shared_head.head` copies there are not loaded). For the token at
position i+1 and the trunk's final (normed) hidden state at position i:

    x = eh_proj(cat(enorm(embed(token[i+1])), hnorm(hidden[i])))
    x = decoder_layer(x) at position i+1, over the MTP layer's own KV cache
    logits = lm_head(shared_head.norm(x))   -> a draft for the token at i+2

Its KV cache is one more layer of the paged cache (the same pages, so it moves, forks and frees with them). Slot i
holds the entry of (token i+1, hidden i): a step that computed the trunk at positions a..b fills slots a..b, and
every slot lies inside the pages the trunk filled. Slot i depends on token i+1, so the last slot of a page depends
on the next page's first token: a prefix-cache hit stops one page short (`PageManager.match_prefix(spare=1)`), and
the recomputed page rewrites that slot. See engine/speculative.py for how the drafts are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mlc.errors import ConfigError
from mlc.layers.linear import Linear
from mlc.layers.norm import RMSNorm
from mlc.layers.weight_target import WeightTarget

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlc.layers.attention import AttentionMetadata
    from mlc.layers.kv_store import LayerCache
    from mlc.models.base import CausalLM

SHARED = ("embed_tokens.", "shared_head.head.")  # the trunk's embedding and head, repeated in some checkpoints


def mtp_layers_of(cfg) -> int:
    """MTP layers a checkpoint's config declares (`num_nextn_predict_layers`, transformers' `num_mtp_layers`)."""
    return int(getattr(cfg, "num_nextn_predict_layers", None) or getattr(cfg, "num_mtp_layers", None) or 0)


def attach_mtp(model: CausalLM, block: nn.Module) -> None:
    """Give `model` its MTP layer: `block` is a decoder layer of the model's own kind (built as layer N), which
    gets the MTP's extra modules so that its parameter names are the checkpoint's, under `mtp.`."""
    cfg = model.config
    if mtp_layers_of(cfg) != 1:
        raise ConfigError(
            f"speculative method \"mtp\" needs a checkpoint with one MTP layer; config.json declares "
            f"num_nextn_predict_layers={mtp_layers_of(cfg)}. Use {{\"method\": \"ngram\"}} for this model")
    hidden = cfg.hidden_size
    block.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
    block.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
    block.eh_proj = Linear(2 * hidden, hidden)
    block.shared_head = nn.Module()
    block.shared_head.norm = RMSNorm(hidden, cfg.rms_norm_eps)
    model.mtp = block


def mtp_weight_target(model: CausalLM, name: str, trunk: Callable[[str], WeightTarget | None]) -> WeightTarget | None:
    """Where a tensor of `model.layers.{N}.*` goes: under `mtp.` where the model has its MTP layer (mapped as the
    trunk maps a layer of that kind, by `trunk`), else nowhere (the base model never reads it)."""
    n = model.config.num_hidden_layers
    prefix = f"model.layers.{n}."
    if model.mtp is None or not name.startswith(prefix) or name[len(prefix):].startswith(SHARED):
        return None
    target = trunk(name)
    if target is None:
        return None
    return WeightTarget("mtp." + target.param.removeprefix(prefix), target.shard, target.expert, target.rows)


def has_mtp_weights(names: set[str], cfg) -> bool:
    return f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in names


def mtp_hidden(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
               meta: AttentionMetadata, cache: LayerCache | None) -> torch.Tensor:
    """The MTP layer's normed output for tokens `ids` at `positions`, each beside the trunk's final hidden state of
    the position before (`previous`); the model runs its decoder layer its own way (`run_mtp_block`)."""
    m: Any = model.mtp
    assert m is not None, "the model was built without its MTP layer (add_mtp)"
    e = model.model.embed_tokens(ids)
    x = m.eh_proj(torch.cat((m.enorm(e), m.hnorm(previous.to(e.dtype))), dim=-1))
    cos, sin = cast(Any, model).rotary(positions, x.dtype)
    return m.shared_head.norm(model.run_mtp_block(x, cos, sin, cache, meta))
