from __future__ import annotations

import torch

from mlc.layers.kv_quant import new_paged_tensor
from mlc.layers.kv_store import LayerCache

KVDtype = torch.dtype | str
"""A float dtype (stored as is), or "int8" / "int4" (quantized stores, `mlc.layers.kv_quant`)."""

KV_DTYPE_NAMES: dict[str, KVDtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                                      "int8": "int8", "int4": "int4"}


def kv_dtype(name: str, model_dtype: torch.dtype) -> KVDtype:
    """The store dtype for a `kv_cache_dtype` setting ("auto": the model's compute dtype)."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"kv_cache_dtype {name!r} is unknown; use auto, {', '.join(KV_DTYPE_NAMES)}")
    return KV_DTYPE_NAMES[name]


class KVCache:
    def __init__(
        self,
        spec: list[dict[str, tuple[int, ...]]],
        num_pages: int,
        page_size: int,
        dtype: KVDtype,
        device: torch.device | str = "cpu",
    ):
        self.spec, self.num_pages, self.page_size, self.dtype = spec, num_pages, page_size, dtype
        self.device = torch.device(device)
        slots = num_pages * page_size
        self.layers: list[LayerCache] = [
            {name: new_paged_tensor(slots, shape, dtype, device) for name, shape in layer.items()} for layer in spec
        ]
        self.clear_null_page()

    def clear_null_page(self) -> None:
        """Page 0 is the null page padded gathers read: it must hold zeros."""
        for layer in self.layers:
            for tensor in layer.values():
                tensor.clear(slice(0, self.page_size))

    def touch(self) -> int:
        """Write every page once (zeros), so that a CPU server's resident memory after start is what it keeps: the
        pool is allocated empty, and untouched pages would otherwise join the RSS one by one over hours of
        traffic. Returns the bytes touched."""
        for layer in self.layers:
            for tensor in layer.values():
                tensor.clear(slice(None))
        return self.total_bytes()

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries between slots in every layer (copy-on-write of shared pages, sparse-KV compaction)."""
        device = next(iter(self.layers[0].values())).data.device
        src, dst = src.to(device), dst.to(device)
        for layer in self.layers:
            for tensor in layer.values():
                tensor.copy_slots(src, dst)

    @staticmethod
    def layer_bytes_per_token_for(spec: list[dict[str, tuple[int, ...]]], dtype: KVDtype) -> list[int]:
        """Bytes one token costs in each layer, from the stores themselves (codes and scales counted)."""
        return [
            sum(new_paged_tensor(1, shape, dtype, "meta").bytes_per_token() for shape in layer.values())
            for layer in spec
        ]

    @staticmethod
    def bytes_per_token_for(spec: list[dict[str, tuple[int, ...]]], dtype: KVDtype) -> int:
        return sum(KVCache.layer_bytes_per_token_for(spec, dtype))

    def bytes_per_token(self) -> int:
        return sum(t.bytes_per_token() for layer in self.layers for t in layer.values())

    def total_bytes(self) -> int:
        return self.bytes_per_token() * self.num_pages * self.page_size
