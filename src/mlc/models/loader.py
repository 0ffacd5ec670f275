"""Load a model to serve: resolve it, check its files, build its architecture, load its weights (a plain HF
checkpoint or a `mlc-cli compile` output), then quantize them if asked."""

from __future__ import annotations

from pathlib import Path

import torch

from mlc.config.device import resolve_device, resolve_dtype
from mlc.models.base import CausalLM
from mlc.models.compiled import install_quantized_layers, is_compiled, read_compiled_manifest
from mlc.models.hf_checkpoint import build_model, iter_safetensors, read_config, safetensors_files


def _load_compiled(net: CausalLM, model_dir: Path, weight_dtype: str) -> str:
    """Weights of a `mlc-cli compile` output; returns the weight dtype still to apply ("auto": none)."""
    from mlc.errors import ConfigError

    manifest = read_compiled_manifest(model_dir)
    compiled = manifest["options"]["weight_dtype"]
    if compiled != "auto":
        if weight_dtype not in ("auto", compiled):
            raise ConfigError(f"{model_dir} is compiled with weight_dtype {compiled}; drop --weight-dtype {weight_dtype} "
                              "or compile the source checkpoint again")
        install_quantized_layers(net, model_dir, manifest)
        weight_dtype = "auto"
    quantized = tuple(f"{name}." for name in manifest["quantized_layers"])
    with torch.no_grad():
        net.load_weights((k, v) for k, v in iter_safetensors(safetensors_files(model_dir)) if not k.startswith(quantized))
    return weight_dtype


def load_model(model: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               weight_dtype: str = "auto", verify: bool = False) -> CausalLM:
    """Resolve a store name, checkpoint dir or .gguf file, check a store model's files against its manifest
    (sampled hashes; every byte with `verify`), build its architecture and load its weights
    (then quantize them to `weight_dtype`, see mlc.layers.quant)."""
    from mlc.models.store import resolve_model_dir
    from mlc.models.store_verify import check_at_load

    model_dir = resolve_model_dir(model)
    check_at_load(model_dir, full=verify)
    cfg = read_config(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None))
    net = build_model(cfg, dev, dt)
    if is_compiled(model_dir):
        weight_dtype = _load_compiled(net, model_dir, weight_dtype)
    else:
        with torch.no_grad():
            net.load_weights(iter_safetensors(safetensors_files(model_dir)))
    if weight_dtype != "auto":
        from mlc.layers.quant import quantize_model

        net.quant_report = quantize_model(net, weight_dtype)
    net.model_dir = model_dir
    return net
