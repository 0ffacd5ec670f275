"""The KV cache: preallocated once, per layer and per cache tensor, in pages of `page_size` slots."""

from __future__ import annotations

import torch

from mlc.layers.kv_store import LayerCache, PagedTensor


class KVCache:
    def __init__(
        self,
        spec: list[dict[str, tuple[int, ...]]],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.spec, self.num_pages, self.page_size = spec, num_pages, page_size
        slots = num_pages * page_size
        self.layers: list[LayerCache] = [
            {name: PagedTensor(slots, shape, dtype, device) for name, shape in layer.items()} for layer in spec
        ]
        for layer in self.layers:  # page 0 is the null page padded gathers read
            for tensor in layer.values():
                tensor.data[:page_size].zero_()

    @staticmethod
    def bytes_per_token_for(spec: list[dict[str, tuple[int, ...]]], dtype: torch.dtype) -> int:
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(size * int(torch.Size(shape).numel()) for layer in spec for shape in layer.values())

    def bytes_per_token(self) -> int:
        return sum(t.bytes_per_token() for layer in self.layers for t in layer.values())

    def total_bytes(self) -> int:
        return self.bytes_per_token() * self.num_pages * self.page_size
