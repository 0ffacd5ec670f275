"""GGUF tensors back to fp32 numpy arrays, for the quantization types the `gguf` package implements."""

from __future__ import annotations

import numpy as np

from mlc.errors import ModelFormatError
from mlc.models.gguf.reader import GGUFFile

# Types `gguf.quants.dequantize` implements in numpy; anything else (Q8_1, Q8_K, integer types) is refused.
SUPPORTED_QUANTS = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "MXFP4",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
)


def quant_type_name(tensor) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(tensor.tensor_type)).name
    except ValueError:
        return f"type {int(tensor.tensor_type)}"


def check_quant_types(gf: GGUFFile) -> None:
    """Fail before any work when a tensor uses a type we cannot dequantize."""
    for t in gf.reader.tensors:
        kind = quant_type_name(t)
        if kind not in SUPPORTED_QUANTS:
            raise ModelFormatError(
                f"{gf.path.name}: tensor {t.name!r} is stored as {kind}, which mlc cannot dequantize; "
                f"supported types: {', '.join(SUPPORTED_QUANTS)} (re-quantize with llama-quantize, e.g. to Q8_0)"
            )


def dequantize_tensor(tensor) -> np.ndarray:
    """fp32 array in numpy (row-major, HF `[out, in]`) order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, GGMLQuantizationType(int(tensor.tensor_type)))
    except NotImplementedError:
        raise ModelFormatError(
            f"tensor {tensor.name!r} is stored as {quant_type_name(tensor)}, which mlc cannot dequantize; "
            f"supported types: {', '.join(SUPPORTED_QUANTS)}"
        ) from None
    return np.array(values.reshape(shape), dtype=np.float32, order="C")  # a copy: F32 data is a read-only memmap
