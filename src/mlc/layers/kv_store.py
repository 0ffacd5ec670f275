"""Paged storage for one named per-token cache tensor of one layer (K, V, an MLA latent, indexer keys).

Storage is flat over slots: slot = page * page_size + offset. Values are written and read in the compute
dtype; the storage dtype may be narrower (fp16/bf16), and quantized stores (int8/int4, `kv_quant.py`) subclass this.
`bytes_per_token()` is what one token costs in this store, everything counted (codes and scales).
"""

from __future__ import annotations

import torch


class PagedTensor:
    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        self.shape = tuple(shape)
        # empty, not zeros: pages are touched (and count in RSS) only when written
        self.data = torch.empty((num_slots, *self.shape), dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    def bytes_per_token(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.data.index_copy_(0, slots, values if values.dtype == self.data.dtype else values.to(self.data.dtype))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values at `slots` (any shape), as `[*slots.shape, *self.shape]` in `dtype`."""
        # index_select over rows is several times faster on CPU than advanced indexing
        rows = self.data.view(self.data.shape[0], -1).index_select(0, slots.reshape(-1))
        out = rows.view(*slots.shape, *self.shape)
        return out if out.dtype == dtype else out.to(dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move entries between slots (copy-on-write of shared pages, sparse-KV compaction)."""
        self.data[dst] = self.data[src]

    def clear(self, slots: slice) -> None:
        """Zero these slots (the reserved null page that padded gathers read)."""
        self.data[slots] = 0


LayerCache = dict[str, PagedTensor]
