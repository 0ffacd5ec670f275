"""A glm4moe GGUF's routed experts served from the file's own blocks. llama.cpp stores each MoE layer's experts as
three stacked tensors (`ffn_gate_exps`, `ffn_up_exps` `[E, I, H]`, `ffn_down_exps` `[E, H, I]`); each expert's
rows are one contiguous slice of them, so expert e becomes a `GGUFLinear` gate|up of its two slices and one of its
down slice, in the routing arithmetic of `QuantizedExperts`. Where a stack's type has no kernel (or the experts
are split across tensor-parallel ranks), the stacks are dequantized into `RoutedExperts` (`glm4_moe.float_experts`)."""

from __future__ import annotations

from typing import Any

from mlc.errors import ModelFormatError
from mlc.layers.gguf_linear import GGUFLinear, GGUFPart, as_tensor, gguf_kernel_fits
from mlc.layers.moe import RoutedExperts
from mlc.layers.quant_moe import QuantizedExperts
from mlc.models.gguf.dequant import quant_type_name
from mlc.models.gguf.glm4_moe import PROJECTIONS


def _dims(tensor) -> tuple[int, int, int]:
    """(experts, rows of one expert, columns) of a stacked tensor."""
    cols, rows, experts = (int(n) for n in tensor.shape)
    return experts, rows, cols


def _expert_part(tensor, e: int) -> GGUFPart:
    _, rows, _ = _dims(tensor)
    return GGUFPart(as_tensor(tensor.data[e * rows : (e + 1) * rows]), quant_type_name(tensor), None,
                    f"{tensor.name}[{e}]")


def servable(stack: dict[str, Any], module: RoutedExperts) -> bool:
    """The gguf kernel reads every stack of this layer, and this process holds every expert whole."""
    if module.split != 1 or module.n_experts != module.total:
        return False
    return all(_dims(t)[0] == module.total and gguf_kernel_fits(quant_type_name(t), *_dims(t)[1:])
               for t in stack.values())


def gguf_experts(stack: dict[str, Any], module: RoutedExperts) -> QuantizedExperts:
    """One `GGUFLinear` gate|up and one down per expert, from slices of the stacks (no float copy)."""
    gate, up, down = (stack[p] for p in PROJECTIONS)
    _, inter, hidden = _dims(gate)
    if _dims(up)[1:] != (inter, hidden) or _dims(down)[1:] != (hidden, inter):
        raise ModelFormatError(f"{gate.name}, {up.name}, {down.name}: shapes {gate.shape}, {up.shape}, {down.shape} "
                               "do not make SwiGLU experts; the GGUF is damaged")
    n = range(module.total)
    return QuantizedExperts(
        [GGUFLinear([_expert_part(gate, e), _expert_part(up, e)], hidden, None, [inter, inter]) for e in n],
        [GGUFLinear([_expert_part(down, e)], inter) for e in n], module.total)

