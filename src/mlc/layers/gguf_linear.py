"""Layers served from a GGUF's own blocks by the C++ gguf kernel (`csrc/gguf_linear.cpp`, `csrc/gguf_blocks.h`):
each matrix keeps its file type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), its codes and its
scales, repacked at load into tiles of 16 output rows (`gguf_pack`), and meets activations quantized per row to two
int8 digits (about 16 bits) in exact integer dot products. Nothing is dequantized to float or quantized again.

`GGUFLinear` stands in for a Linear or MergedLinear: a merged layer whose parts have different types (a Q4_K_M
file's q and k in Q4_K, v in Q6_K) runs one kernel call per run of equal types. `GGUFEmbedding` looks rows up in the
file's mapped blocks and dequantizes only those (the file's mapping is shared, not copied).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.quant_linear import QuantizedLinear

# the order of gguf_blocks.h's Kind enum
GGUF_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
_SUPER = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # 256-value super-blocks: rows must be whole ones


def gguf_kernel_fits(kind: str, rows: int, cols: int) -> bool:
    """The gguf kernel serves this matrix: a type it reads, output rows in tiles of 16, whole blocks per row."""
    return kind in GGUF_KINDS and rows % 16 == 0 and cols % (256 if kind in _SUPER else 32) == 0


def gguf_kernels_available() -> bool:
    return cpu_op("gguf_linear") is not None


def as_tensor(raw: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's mapped bytes `[rows, bytes per row]` as a uint8 tensor sharing the mapping (read only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable; nothing here writes it
        return torch.from_numpy(np.asarray(raw, dtype=np.uint8))


@dataclass
class GGUFPart:
    """One GGUF matrix bound for a layer: its mapped blocks, its type, and the order its rows are served in (None:
    as stored; llama's q and k are stored in llama.cpp's rope order)."""

    raw: torch.Tensor
    kind: str
    rows: torch.Tensor | None = None
    name: str = "?"  # the GGUF tensor's name, for errors

    @property
    def out_features(self) -> int:
        return int(self.raw.shape[0] if self.rows is None else self.rows.numel())

    def ordered(self) -> torch.Tensor:
        return self.raw if self.rows is None else self.raw.index_select(0, self.rows)


class GGUFLinear(QuantizedLinear):
    """A Linear (or MergedLinear: its parts in shard order) computed from GGUF blocks by the gguf kernel."""

    packed0: torch.Tensor  # the first run's tiles (a buffer; packed1, ... for further runs)

    def __init__(self, parts: list[GGUFPart], in_features: int, bias: torch.Tensor | None = None,
                 shard_sizes: list[int] | None = None):
        if not gguf_kernels_available():
            raise ModelFormatError("GGUF blocks are served by the C++ CPU kernels, which are not built here (no C++ "
                                   "compiler, or MLC_CPU_KERNELS=0); load the model without them (the loader "
                                   "dequantizes what it cannot serve)")
        shape = torch.empty(sum(p.out_features for p in parts), in_features, device="meta")
        super().__init__(shape, bias, shard_sizes)
        self.parts = parts  # kept for `dequantized` (the file's mapping, no memory of its own)
        self.runs: list[tuple[int, int]] = []  # (kind index, out rows) per kernel call
        packed = []
        for kind, run in _runs(parts):
            raw = torch.cat([p.ordered() for p in run]) if len(run) > 1 else run[0].ordered()
            packed.append(_pack(raw.contiguous(), kind, in_features, run))
            self.runs.append((GGUF_KINDS.index(kind), raw.shape[0]))
        for i, p in enumerate(packed):
            self.register_buffer(f"packed{i}", p)
        self.kernel = "gguf-" + "+".join(dict.fromkeys(p.kind for p in parts))

    def matmul(self, x):
        op = cpu_op("gguf_linear")
        if len(self.runs) == 1:  # most layers: one call, no list (this runs a hundred times a token)
            return self._add_bias(op(x, self.packed0, self.runs[0][0]))
        ys = [op(x, getattr(self, f"packed{i}"), kind) for i, (kind, _) in enumerate(self.runs)]
        return self._add_bias(torch.cat(ys, dim=-1))

    def dequantized(self, dtype=torch.float32):
        rows = cpu_op("gguf_rows")
        return torch.cat([rows(p.raw.contiguous(), torch.arange(p.raw.shape[0]) if p.rows is None else p.rows,
                               GGUF_KINDS.index(p.kind), self.in_features) for p in self.parts]).to(dtype)

    def weight_bytes(self):
        return sum(getattr(self, f"packed{i}").numel() for i in range(len(self.runs))) + self._bias_bytes()


def _pack(raw: torch.Tensor, kind: str, cols: int, run: list[GGUFPart]) -> torch.Tensor:
    try:
        return cpu_op("gguf_pack")(raw, GGUF_KINDS.index(kind), cols)
    except RuntimeError as e:
        names = ", ".join(p.name for p in run)
        detail = str(e).strip().splitlines()[0]
        raise ModelFormatError(f"tensor {names} ({kind}): {detail}; the file is damaged: download it again") from None


def _runs(parts: list[GGUFPart]) -> list[tuple[str, list[GGUFPart]]]:
    """Consecutive parts of one type, grouped (one kernel call each)."""
    runs: list[tuple[str, list[GGUFPart]]] = []
    for p in parts:
        if runs and runs[-1][0] == p.kind:
            runs[-1][1].append(p)
        else:
            runs.append((p.kind, [p]))
    return runs


class GGUFEmbedding(nn.Module):
    """Token embedding read from a GGUF's mapped blocks: each step dequantizes only the rows it looks up."""

    probe: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, part: GGUFPart, dim: int, dtype: torch.dtype):
        super().__init__()
        self.part, self.dim, self.kind = part, dim, GGUF_KINDS.index(part.kind)
        self.register_buffer("probe", torch.empty(0, dtype=dtype))  # follows .to(dtype): the output dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.probe.dtype

    @property
    def device(self) -> torch.device:
        return self.probe.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_op("gguf_rows")(self.part.raw, ids.reshape(-1), self.kind, self.dim)
        return rows.to(self.probe.dtype).reshape(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"rows={self.part.raw.shape[0]}, dim={self.dim}, kind={self.part.kind}"
