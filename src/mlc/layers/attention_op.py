"""Paged attention as an opaque custom op, `mlc::paged_attention`, for a `torch.compile`d forward pass
(`engine/compiled_forward.py`): its metadata (Python lists and groups) and the KV cache cannot be traced, so
the op reads them from `STEP`, which the compiled forward sets around each call. Eager code calls
`paged_attention` directly; `attend` picks."""

from __future__ import annotations

import torch

from mlc.layers.attention import paged_attention

STEP: dict = {}  # "meta" and "caches" of the step a compiled forward is running


@torch.library.custom_op("mlc::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    caches = STEP["caches"]
    return paged_attention(q, k, v, caches[layer] if caches is not None else None, STEP["meta"], scale)


@_paged_attention_op.register_fake
def _(q, k, v, layer, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def attend(q, k, v, cache, meta, scale: float, layer: int) -> torch.Tensor:
    """Paged attention: the eager function, or the opaque op inside a compiled graph."""
    if torch.compiler.is_compiling():
        return torch.ops.mlc.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), layer, scale)
    return paged_attention(q, k, v, cache, meta, scale)
