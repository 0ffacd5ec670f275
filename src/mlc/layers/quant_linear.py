"""Quantized stand-ins for `Linear` / `MergedLinear`, built from a loaded float weight (checkpoints load in float,
then `mlc.layers.quant.quantize_model` swaps the layers).

Each layer picks a CPU kernel when torch has it and the shape fits, else a pure-torch reference path that
dequantizes the weight per call (CUDA, NPU, odd shapes); `kernel` says which one runs. Error bounds, relative to
the float layer's output norm, asserted by tests/unit/test_quant.py: int8 W8A16 < 1%, int8 W8A8 < 2.5%,
int4 g32 < 12%, fp16 < 0.1%, bf16 < 1%.

The CPU kernels' packed weights are opaque and stay on the CPU: quantize on the device the model will run on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers import quant_kernels as qk
from mlc.layers.cpu_kernels import cpu_op, on_huge_pages

_RANGE_PINS = torch.tensor([[1.0, -1.0]])  # appended to every row by Int8Linear's W8A8 (made once, not per call)


class QuantizedLinear(nn.Module):
    """What every quantized layer shares with Linear/MergedLinear: shapes, a float bias, `split` of merged rows."""

    bias: torch.Tensor | None  # buffers, declared for the type checker (nn.Module's __getattr__ types them loosely)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shard_sizes: list[int] | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.shard_sizes = list(shard_sizes or [self.out_features])
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the models' flat [tokens, hidden]: skip two reshapes per layer per step
            return self.matmul(x)
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight `[N, K]` this layer multiplies by (what the reference path computes with)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of weight storage, scales and bias included (packed kernel layouts counted by their payload)."""
        raise NotImplementedError

    def _bias_bytes(self) -> int:
        return 0 if self.bias is None else self.bias.numel() * self.bias.element_size()

    def _bias_like(self, y: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(y.dtype)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.shard_sizes, dim=-1))

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor, is_bias: bool) -> None:
        raise ModelFormatError(f"{name}: this layer is already quantized; load all weights first, then quantize")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Int8Linear(QuantizedLinear):
    """int8 weights, one symmetric scale per output row. `scheme` says what meets them on the CPU:

    w8a8: the C++ kernel where it builds (`csrc/int8_linear.cpp`, kernel "mlc-int8"): each row's activations as two
    int8 digits per 32 inputs (about 16 bits), exact integer dot products, a row alone. Else fbgemm's dynamic linear
    ("fbgemm-w8a8"): activations quantized to uint8 per token, int32 accumulation; a row's result never depends on
    the other rows of its batch either (see `_dynamic_per_token`). Both 2.5-5x int8pack on a 49,152-row head at batch
    1-32. The default head; quantize_model's "mixed" uses it everywhere except where inputs carry outlier channels.
    w8a16: activations rounded to bf16, weights widened in the kernel (aten._weight_int8pack_mm).
    w8a8i: each token's activations quantized to int8 with its own scale, then an int8 x int8 GEMM with exact int32
    accumulation (aten._int_mm): batch-independent too, slower than w8a8 at batch 1-8.
    Off the CPU they all run the reference path, which is W8A16 in the activation dtype.
    """

    qweight: torch.Tensor
    scale: torch.Tensor | None  # None under mlc-int8 (the scales are packed into qweight)

    def __init__(self, weight, bias=None, shard_sizes=None, scheme: str = "w8a8", use_kernels: bool = True,
                 codes: dict[str, torch.Tensor] | None = None):
        """`codes` ({"qweight", "scale"} as `export_codes` wrote them) skip quantizing; `weight` then only gives
        the shape (a meta tensor will do)."""
        super().__init__(weight, bias, shard_sizes)
        q, scale = (codes["qweight"], codes["scale"].float()) if codes else qk.quantize_int8(weight)
        self.scheme = scheme
        self._packed = None
        on_cpu = use_kernels and q.device.type == "cpu"
        if on_cpu and scheme == "w8a8" and qk.int8_tiles_fit(*q.shape) and cpu_op("int8_linear") is not None:
            self.register_buffer("qweight", on_huge_pages(qk.pack_int8_tiles(q, scale)))  # codes, scales: one stream
            self.register_buffer("scale", None)
            self.kernel = "mlc-int8"
            return
        if on_cpu and scheme == "w8a8" and qk.has_fbgemm_int8():
            # two zero columns meet the +1 and -1 that `_dynamic_per_token` appends to every row
            self._packed = qk.prepack_int8(torch.cat((q, q.new_zeros(q.shape[0], 2)), dim=1), scale)
            self.reduce_range = not qk.cpu_has_vnni()
            self.kernel = "fbgemm-w8a8"
            return
        self.register_buffer("qweight", q)
        if on_cpu and scheme == "w8a16" and qk.has_int8pack():
            self.register_buffer("scale", scale.to(torch.bfloat16))
            self.kernel = "int8pack-w8a16"
        elif on_cpu and scheme == "w8a8i" and qk.has_int_mm():
            self.register_buffer("scale", scale)
            self.kernel = "int_mm-w8a8"
        else:
            self.register_buffer("scale", scale)

    def matmul(self, x):
        if self.kernel == "mlc-int8":
            return self._add_bias(cpu_op("int8_linear")(x, self.qweight))
        if self.kernel == "fbgemm-w8a8":
            return self._add_bias(self._dynamic_per_token(x.float()).to(x.dtype))
        if self.kernel == "int8pack-w8a16":
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.scale)
            return self._add_bias(y.to(x.dtype))
        assert self.scale is not None  # every path but mlc-int8's (returned above) keeps its scales apart
        if self.kernel == "int_mm-w8a8":
            codes, row_scale = qk.int8_per_token(x)
            y = torch._int_mm(codes, self.qweight.t()).float() * row_scale * self.scale
            return self._add_bias(y.to(x.dtype))
        return F.linear(x, qk.dequantize_int8(self.qweight, self.scale, x.dtype), self._bias_like(x))

    def _dynamic_per_token(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm quantizes its whole input with one scale and zero point, from the input's min and max. Each row
        is divided by its own absolute max (the layer is linear in each row, so it is scaled back after), which
        puts every row in [-1, 1]; a +1 and a -1 appended to every row (against zero weight columns) make the
        range exactly [-1, 1] whatever the batch holds. So each token is quantized with its own scale, a prompt's
        few huge-activation tokens (the first one, delimiters) cost the others nothing, and a row's result is the
        same alone or in any batch (integer accumulation, the same affine map)."""
        amax = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        pinned = torch.cat((x / amax, _RANGE_PINS.expand(x.shape[0], 2)), dim=1)
        return torch.ops.quantized.linear_dynamic(pinned, self._packed, self.reduce_range) * amax

    def dequantized(self, dtype=torch.float32):
        if self.kernel == "mlc-int8":
            return qk.dequantize_int8(*qk.unpack_int8_tiles(self.qweight), dtype)
        if self._packed is not None:  # without the two pinning columns
            return torch.ops.quantized.linear_unpack(self._packed)[0].dequantize()[:, : self.in_features].to(dtype)
        assert self.scale is not None  # only mlc-int8 packs its scales into qweight
        return qk.dequantize_int8(self.qweight, self.scale.float(), dtype)

    def weight_bytes(self):
        scale_bytes = 4 if self._packed is not None or self.scale is None else self.scale.element_size()
        return self.out_features * (self.in_features + scale_bytes) + self._bias_bytes()


class Int4Linear(QuantizedLinear):
    """Group-wise int4, `w = q * scale + offset` with an fp16 scale and offset per `group_size` inputs of a row
    (a GGUF's Q4_0 and Q4_1 blocks exactly). Two CPU kernels:

    mlc-int4 (the default where it builds, `csrc/int4_linear.cpp`): each row's activations become two int8 digits
    per block of 32 inputs (about 16 bits) and meet the int4 codes in exact integer dot products (VNNI, AVX2 or plain
    C++, the same integers), folded in float in a fixed order. A row's result never depends on its batch. Batch 1
    runs at about twice, and prompts at about three times, the speed of torch's kernel here.
    int4pack-w4a16: aten._weight_int4pack_mm_for_cpu (bf16 activations, weights widened in the kernel, its scales in
    bf16, needs out_features % 16 == 0); where the C++ kernels are not built (`MLC_CPU_KERNELS=0`, no compiler).

    `codes` gives the quantized weights as they are: {"qweight": two values a byte `[N, K/2]`, "scale_offsets"}
    (a compiled model's, or a GGUF's blocks); otherwise `weight` is quantized here.
    """

    qweight: torch.Tensor
    scale_offsets: torch.Tensor | None  # None under mlc-int4 (the scales are packed into qweight)

    def __init__(self, weight, bias=None, shard_sizes=None, group_size: int = 32, use_kernels: bool = True,
                 codes: dict[str, torch.Tensor] | None = None):
        super().__init__(weight, bias, shard_sizes)
        self.group_size = group_size
        if codes:
            q, scale_offsets = qk.unpack_int4(codes["qweight"]), codes["scale_offsets"].to(qk.INT4_SCALE_DTYPE)
        else:
            q, scale_offsets = qk.quantize_int4(weight, group_size)
        fits = qk.int4pack_fits(self.out_features, self.in_features, group_size)
        on_cpu = use_kernels and q.device.type == "cpu" and fits
        if on_cpu and cpu_op("int4_linear") is not None:  # codes and scales in one stream (no separate scales)
            self.register_buffer("qweight", on_huge_pages(qk.pack_int4_tiles(q, scale_offsets, group_size)))
            self.register_buffer("scale_offsets", None)
            self.kernel = "mlc-int4"
            return
        if on_cpu and qk.has_int4pack():
            self.register_buffer("scale_offsets", qk.to_tinygemm(scale_offsets))  # bf16 (scale, zero), its format
            self.register_buffer("qweight", qk.prepack_int4(q))
            self.kernel = "int4pack-w4a16"
        else:
            self.register_buffer("scale_offsets", scale_offsets)
            self.register_buffer("qweight", qk.pack_int4(q))

    def matmul(self, x):
        if self.kernel == "mlc-int4":
            return self._add_bias(cpu_op("int4_linear")(x, self.qweight, self.group_size))
        if self.kernel == "int4pack-w4a16":
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # a bf16 model skips both conversions
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.qweight, self.group_size,
                                                           self.scale_offsets)
            return self._add_bias(y if x.dtype == torch.bfloat16 else y.to(x.dtype))
        assert self.scale_offsets is not None  # only mlc-int4 (returned above) packs its scales into qweight
        w = qk.dequantize_int4(self.qweight, self.scale_offsets, self.group_size, x.dtype)
        return F.linear(x, w, self._bias_like(x))

    def dequantized(self, dtype=torch.float32):
        if self.kernel == "mlc-int4":
            q, scale_offsets = qk.unpack_int4_tiles(self.qweight, self.group_size)
            return qk.dequantize_int4(qk.pack_int4(q), scale_offsets, self.group_size, dtype)
        if self.kernel == "int4pack-w4a16":  # the kernel's layout is its own; multiply the identity to read it back
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scale_offsets)
            return w.t().to(dtype)
        assert self.scale_offsets is not None  # only mlc-int4 (returned above) packs its scales into qweight
        return qk.dequantize_int4(self.qweight, self.scale_offsets, self.group_size, dtype)

    def weight_bytes(self):
        if self.kernel == "mlc-int4":  # scales inside
            return self.qweight.numel() + self._bias_bytes()
        assert self.scale_offsets is not None  # only mlc-int4 (returned above) packs its scales into qweight
        return self.out_features * self.in_features // 2 + self.scale_offsets.numel() * 2 + self._bias_bytes()


class HalfLinear(QuantizedLinear):
    """fp16 or bf16 weight storage under fp32 (or any wider) compute. CPU: fp16 runs fbgemm's fp16-weight GEMM
    with fp32 activations; bf16 runs a bf16 GEMM (activations rounded to bf16, fp32 accumulation)."""

    weight_half: torch.Tensor

    def __init__(self, weight, bias=None, shard_sizes=None, dtype: torch.dtype = torch.float16,
                 use_kernels: bool = True, codes: dict[str, torch.Tensor] | None = None):
        super().__init__(weight, bias, shard_sizes)
        if codes:
            weight = codes["weight_half"]
        self.storage_dtype = dtype
        self._packed = None
        on_cpu = use_kernels and weight.device.type == "cpu"
        if on_cpu and dtype == torch.float16 and qk.has_fbgemm_fp16():
            bias32 = None if self.bias is None else self.bias.float()
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), bias32)
            self.kernel = "fbgemm-fp16"
            return
        self.register_buffer("weight_half", weight.detach().to(dtype).contiguous())
        if on_cpu and dtype == torch.bfloat16:
            self.kernel = "bf16-gemm"

    def matmul(self, x):
        if self.kernel == "fbgemm-fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), self._packed).to(x.dtype)
        if self.kernel == "bf16-gemm":
            xb = x.to(torch.bfloat16)
            return F.linear(xb, self.weight_half, self._bias_like(xb)).to(x.dtype)
        return F.linear(x, self.weight_half.to(x.dtype), self._bias_like(x))

    def dequantized(self, dtype=torch.float32):
        if self._packed is not None:
            return torch.ops.quantized.linear_unpack_fp16(self._packed)[0].to(dtype)
        return self.weight_half.to(dtype)

    def weight_bytes(self):
        return self.out_features * self.in_features * 2 + self._bias_bytes()
