"""Kernel micro-benchmark behind the choices in mlc.layers.quant: each candidate CPU matmul on the default model's
linear shapes at decode batch sizes, median microseconds per call.

`stream_mb` > 0 cycles through enough copies of each weight (counted in fp32 bytes) that it is not all in cache,
as in a real decode step, where every layer's weight comes from memory once; 0 times the hot-cache case.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (in_features, out_features) of SmolLM2-135M: o_proj, qkv, gate_up, down, lm_head
SHAPES = ((576, 576), (576, 960), (576, 3072), (1536, 576), (576, 49152))
BATCHES = (1, 4, 8, 32)


@dataclass
class KernelTiming:
    kernel: str
    in_features: int
    out_features: int
    batch: int
    us: float | None  # None: not available here, or the shape does not fit it
    rel_error: float | None  # ||y - y_fp32|| / ||y_fp32|| on random data


def candidates(w: torch.Tensor) -> dict:
    """name -> callable(x) for one fp32 weight `[N, K]`; kernels torch lacks here are left out."""
    from mlc.layers import quant_kernels as qk
    from mlc.layers.quant_linear import HalfLinear, Int4Linear, Int8Linear

    n, k = w.shape
    out: dict = {"fp32 (MKL)": lambda x: F.linear(x, w)}
    wb = w.bfloat16()
    out["bf16 weights+activations"] = lambda x: F.linear(x.bfloat16(), wb).float()
    out["bf16 storage, upcast per call"] = lambda x: F.linear(x, wb.float())
    for label, make in (("fp16 fbgemm (ours: fp16)", lambda: HalfLinear(w, dtype=torch.float16)),
                        ("int8 W8A8 fbgemm (ours)", lambda: Int8Linear(w, scheme="w8a8")),
                        ("int8 W8A16 int8pack (ours)", lambda: Int8Linear(w, scheme="w8a16"))):
        layer = make()
        if layer.kernel != "reference":
            out[label] = layer
    q, scale = qk.quantize_int8(w)
    out["int8 W8A16 int8pack, fp32 act"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)
    q_t = q.t().contiguous()

    def int_mm(x):
        sx = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(x / sx).to(torch.int8)
        return torch._int_mm(xq, q_t).float() * sx * scale

    out["int8 W8A8 torch._int_mm, per token"] = int_mm
    for g in (32, 64, 128):
        if qk.int4pack_fits(n, k, g):
            out[f"int4 g{g} int4pack (ours)"] = Int4Linear(w, group_size=g)
    if hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit") and k % 32 == 0:
        out["int4 g32 _dyn_quant_matmul_4bit"] = _dyn_quant_4bit(w, 32)
    return out


def _dyn_quant_4bit(w: torch.Tensor, group: int):
    """Symmetric int4 through the KleidiAI op (ARM); on x86 torch runs a fallback."""
    n, k = w.shape
    grouped = w.reshape(n, k // group, group)
    s = (grouped.abs().amax(dim=-1) / 7).clamp(min=1e-8)
    q = (torch.round(grouped / s[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k)
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight((q[:, 1::2] << 4) | q[:, 0::2], s, None, group, k, n)
    return lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, group, k, n)


def _time(fns: list, x: torch.Tensor, budget_s: float) -> float:
    i = 0
    for f in fns[:2]:
        f(x)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(samples) < 5:
        f = fns[i % len(fns)]
        i += 1
        t = time.perf_counter()
        f(x)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def run_kernel_bench(shapes=SHAPES, batches=BATCHES, threads: int | None = None, stream_mb: int = 256,
                     budget_s: float = 0.2, seed: int = 0) -> list[KernelTiming]:
    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    rows: list[KernelTiming] = []
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        for k, n in shapes:
            copies = max(1, math.ceil(stream_mb * 2**20 / (4 * n * k))) if stream_mb else 1
            weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(copies)]
            built = [candidates(w) for w in weights]
            for m in batches:
                x = torch.randn(m, k, generator=gen)
                ref = F.linear(x, weights[0])
                for name in built[0]:
                    err = ((built[0][name](x) - ref).norm() / ref.norm()).item()
                    us = _time([b[name] for b in built], x, budget_s)
                    rows.append(KernelTiming(name, k, n, m, us, err))
            del weights, built
    return rows
