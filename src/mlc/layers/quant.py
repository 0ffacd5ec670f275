"""`quantize_model`: swap a loaded model's linear layers (and MoE experts) for quantized ones, freeing the floats.

weight_dtype (EngineConfig.weight_dtype, `--weight-dtype`):
  auto / the compute dtype  nothing changes
  fp16, bf16                half-precision storage, compute stays in the model dtype (a memory option)
  int8                      per-channel int8; on CPU W8A8 (C++ kernel, or fbgemm); `int8_scheme="w8a16"`: W8A16
  int4                      group-wise int4 (C++ kernel or W4A16), `group_size` 32 (default), 64, 128, 256 per scale

Embeddings stay in float. A tied lm_head gets its own quantized copy of the embedding matrix (the lookup keeps the
float one), since the head is the largest matmul of a decode step in small models. Kept in float on purpose: the
MoE router (a TopkRouter, not a Linear), the DSA indexer (its scores pick the attended tokens) and any layer whose
input width the int4 group size does not divide (listed in the report).
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from mlc.distributed.state import parallel_state
from mlc.errors import ConfigError
from mlc.layers import quant_kernels as qk
from mlc.layers.linear import Linear, MergedLinear
from mlc.layers.moe import RoutedExperts
from mlc.layers.quant_kernels import INT4_GROUP_SIZES
from mlc.layers.quant_linear import HalfLinear, Int4Linear, Int8Linear, QuantizedLinear
from mlc.layers.quant_moe import QuantizedExperts

log = logging.getLogger("mlc.quant")

WEIGHT_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "int4")
INT8_SCHEMES = ("mixed", "w8a8", "w8a16", "w8a8i")
# inputs with outlier channels (20x the median channel on SmolLM2): the attention input projection after the input
# norm, and the MLP down projection after SwiGLU; W8A8 there costs +4% perplexity, W8A16 +0.1%
_OUTLIER_INPUTS = ("qkv_proj", "q_proj", "k_proj", "v_proj", "down_proj")
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_KEEP_FLOAT = ("indexer.",)  # module-name fragments left in float (see the module docstring)


@dataclass
class QuantReport:
    weight_dtype: str
    layers: int = 0
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> layers using it
    float_bytes: int = 0  # the replaced layers' float weights (tied head: the embedding it copies)
    quantized_bytes: int = 0
    kept_float: list[str] = field(default_factory=list)  # "name: why"

    def count(self, layer: QuantizedLinear) -> None:
        self.layers += 1
        self.kernels[layer.kernel] = self.kernels.get(layer.kernel, 0) + 1
        self.quantized_bytes += layer.weight_bytes()


def check_options(weight_dtype: str, group_size: int = 32, int8_scheme: str = "w8a8") -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype {weight_dtype!r} is unknown; use one of {', '.join(WEIGHT_DTYPES)}")
    if group_size not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group size {group_size} is not supported; use one of {INT4_GROUP_SIZES}")
    if int8_scheme not in INT8_SCHEMES:
        raise ConfigError(f"int8 scheme {int8_scheme!r} is unknown; use mixed, w8a8 (dynamic activations), w8a16 or "
                          "w8a8i (per-token int8 activations, integer GEMM)")


def int8_scheme_for(name: str, int8_scheme: str) -> str:
    """mixed: W8A16 for layers whose inputs carry outlier channels, W8A8 (faster) for the rest."""
    if int8_scheme != "mixed":
        return int8_scheme
    return "w8a16" if any(name.endswith(suffix) for suffix in _OUTLIER_INPUTS) else "w8a8"


def layer_factory(weight_dtype: str, name: str = "", group_size: int = 32, int8_scheme: str = "mixed",
                  use_kernels: bool = True):
    """`make(weight, bias, shard_sizes) -> QuantizedLinear` for the layer called `name`."""
    if weight_dtype == "int8":
        return partial(Int8Linear, scheme=int8_scheme_for(name, int8_scheme), use_kernels=use_kernels)
    if weight_dtype == "int4":
        return partial(Int4Linear, group_size=group_size, use_kernels=use_kernels)
    return partial(HalfLinear, dtype=_FLOATS[weight_dtype], use_kernels=use_kernels)


@torch.no_grad()
def quantize_model(model: nn.Module, weight_dtype: str = "int8", group_size: int = 32, int8_scheme: str = "mixed",
                   use_kernels: bool = True, quantize_experts: bool = True, head_dtype: str | None = None,
                   head_int8_scheme: str | None = None,
                   weight_dtype_for: Callable[[str], str | None] | None = None) -> QuantReport:
    """Replace `model`'s Linear layers in place. `use_kernels=False` forces the pure-torch reference path.
    `head_dtype` quantizes the lm_head differently (a Q4 GGUF keeps its head in Q8_0, and so do we), and
    `head_int8_scheme` gives an int8 head its own scheme. `weight_dtype_for(name)` picks a layer's own weight dtype
    (None: `weight_dtype`), as a GGUF's mix of types asks."""
    check_options(weight_dtype, group_size, int8_scheme)
    compute = model.dtype  # a CausalLM's (its embedding's)
    if not isinstance(compute, torch.dtype):
        raise TypeError(f"{type(model).__name__} has no compute dtype to quantize against")
    target = _FLOATS.get(weight_dtype)
    if weight_dtype == "auto" or target == compute:
        return QuantReport(weight_dtype)
    if target is not None and target.itemsize > compute.itemsize:
        raise ConfigError(f"weight_dtype {weight_dtype} is wider than the compute dtype {compute}; "
                          f"use --dtype {weight_dtype} instead")
    if weight_dtype == "int8" and int8_scheme != "w8a16" and parallel_state().size > 1:
        # W8A8's per-token activation scale would see only a rank's part of a row-parallel layer's input: tensor
        # parallel int8 runs W8A16 everywhere, so a request's tokens do not depend on the tensor-parallel size
        log.info("tensor-parallel int8 runs W8A16 in every layer (not %s)", int8_scheme)
        int8_scheme = head_int8_scheme = "w8a16"
    q = _Quantizer(weight_dtype, group_size, int8_scheme, use_kernels)
    kinds = (Linear, RoutedExperts) if quantize_experts else (Linear,)
    head = getattr(model, "lm_head", None)
    names = [n for n, m in model.named_modules()
             if isinstance(m, kinds) and m is not head and not any(p in n + "." for p in _KEEP_FLOAT)]
    for name in names:  # one at a time, so each float weight is freed as soon as its replacement exists
        own = weight_dtype_for(name) if weight_dtype_for is not None else None
        q.weight_dtype = own if own in ("int8", "int4") else weight_dtype
        _swap(model, name, q.replace(name, model.get_submodule(name)))
    q.weight_dtype = weight_dtype
    if head is not None and not isinstance(head, QuantizedLinear):
        if head_dtype and head_dtype != weight_dtype:
            check_options(head_dtype, group_size, int8_scheme)
            q.weight_dtype = head_dtype
        if head_int8_scheme:
            check_options(q.weight_dtype, group_size, head_int8_scheme)
            q.int8_scheme = head_int8_scheme
        model.lm_head = q.linear("lm_head", head)  # a tied embedding stays where it is, under model.embed_tokens
    del head
    gc.collect()
    release_free_memory()
    r = q.report
    log.info("quantized %d layers to %s (%s): %.1f MB -> %.1f MB", r.layers, weight_dtype, r.kernels,
             r.float_bytes / 1e6, r.quantized_bytes / 1e6)
    return r


@dataclass
class _Quantizer:
    weight_dtype: str
    group_size: int
    int8_scheme: str
    use_kernels: bool
    report: QuantReport = None  # type: ignore[assignment]

    def __post_init__(self):
        self.report = QuantReport(self.weight_dtype)

    def make(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, shards: list[int] | None,
             row_sharded: bool = False):
        extra = {}
        if row_sharded and self.weight_dtype == "int8":
            # each rank holds some input columns: the per-row scale comes from the whole row, as in one process
            extra["codes"] = dict(zip(("qweight", "scale"), qk.quantize_int8(weight, reduce_amax=max_over_ranks)))
        layer = layer_factory(self.weight_dtype, name, self.group_size, self.int8_scheme, self.use_kernels)(
            weight, bias, shards, **extra)
        self.report.float_bytes += _bytes(weight) + (0 if bias is None else _bytes(bias))
        self.report.count(layer)
        return layer

    def fits(self, name: str, in_features: int) -> bool:
        if self.weight_dtype == "int4" and in_features % self.group_size:
            self.report.kept_float.append(
                f"{name}: in_features {in_features} is not a multiple of group size {self.group_size}")
            return False
        return True

    def replace(self, name: str, module: nn.Module) -> nn.Module:
        return self.experts(name, module) if isinstance(module, RoutedExperts) else self.linear(name, module)

    def linear(self, name: str, module: nn.Module) -> nn.Module:
        """A Linear, MergedLinear or a tied Embedding (used as a head) -> its quantized stand-in."""
        weight = module.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{name}: a {type(module).__name__} has no weight matrix to quantize")
        if not self.fits(name, weight.shape[1]):
            return module
        shards = module.shard_sizes if isinstance(module, MergedLinear) else None
        sharding = getattr(module, "tp", None)
        row_parallel = sharding is not None and sharding.mode == "row"
        layer = self.make(name, weight, getattr(module, "bias", None), shards, row_parallel)
        layer.tp = sharding  # LoRA adapters attached later are cut like the float layer was
        return layer

    def experts(self, name: str, experts: RoutedExperts) -> nn.Module:
        if not (self.fits(name + ".gate_up_proj", experts.gate_up_proj.shape[-1])
                and self.fits(name + ".down_proj", experts.down_proj.shape[-1])):
            return experts
        row = experts.split > 1  # experts split inside: down_proj holds a slice of each expert's inputs
        return QuantizedExperts.of(experts, lambda proj, w, shards: self.make(
            f"{name}.{proj}", w, None, shards, row and proj == "down_proj"))


def max_over_ranks(amax: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    amax = amax.contiguous()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=parallel_state().group)
    return amax


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and RSS would not show the saving)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if getattr(parent, attr) is not new:
        setattr(parent, attr, new)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all weights as stored: float parameters plus quantized layers' payloads (each module once)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes()
        else:
            total += sum(_bytes(p) for p in module.parameters(recurse=False))
    return total
