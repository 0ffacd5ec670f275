"""Load a model to serve: resolve it, check its files, build its architecture, load its weights (a plain HF
checkpoint, a GGUF kept in the store, or a `mlc-cli compile` output), then quantize them if asked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mlc.config.device import cpu_has_native_bf16, resolve_device, resolve_dtype
from mlc.distributed.state import tp_size
from mlc.errors import ConfigError
from mlc.layers.quant_linear import QuantizedLinear
from mlc.models.base import CausalLM
from mlc.models.compiled import install_quantized_layers, is_compiled, read_compiled_manifest
from mlc.models.gguf.native import GGUF_WEIGHT_DTYPES
from mlc.models.hf_checkpoint import (
    build_model,
    iter_safetensors,
    model_class,
    read_config,
    safetensors_files,
    safetensors_names,
)


def _load_compiled(net: CausalLM, model_dir: Path, weight_dtype: str) -> str:
    """Weights of a `mlc-cli compile` output; returns the weight dtype still to apply ("auto": none)."""
    from mlc.errors import ConfigError

    manifest = read_compiled_manifest(model_dir)
    compiled = manifest["options"]["weight_dtype"]
    if compiled != "auto" and tp_size() > 1:
        raise ConfigError(f"{model_dir} holds {compiled} layers quantized whole, which tensor parallelism cannot split "
                          "yet; compile with --weight-dtype auto (and --tensor-parallel-size) and quantize at load "
                          "with --weight-dtype, or serve the source checkpoint")
    if compiled != "auto":
        if weight_dtype not in ("auto", compiled):
            raise ConfigError(f"{model_dir} is compiled with weight_dtype {compiled}; "
                              f"drop --weight-dtype {weight_dtype} or compile the source checkpoint again")
        install_quantized_layers(net, model_dir, manifest)
        weight_dtype = "auto"
    quantized = tuple(f"{name}." for name in manifest["quantized_layers"])
    with torch.no_grad():
        net.load_weights((k, v) for k, v in iter_safetensors(safetensors_files(model_dir))
                         if not k.startswith(quantized))
    return weight_dtype


def source_weight_dtypes(model_dir: Path) -> tuple[str, str | None, str] | None:
    """(body weight dtype, head weight dtype, why) for a model converted from a quantized GGUF, else None.

    The body follows the GGUF's most common matrix type. llama.cpp's Q4/Q5 mixes keep the token embedding / output
    in Q8_0 (or Q6_K); when such a wider type is present the head keeps 8 bits too."""
    import json

    from mlc.models.store.paths import MANIFEST

    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
        types: dict[str, int] = manifest["conversion"]["tensor_types"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    mapped = {t: n for t, n in types.items() if t in GGUF_WEIGHT_DTYPES}
    if not mapped:
        return None
    main = max(mapped, key=lambda t: mapped[t])
    body = GGUF_WEIGHT_DTYPES[main]
    head = "int8" if body == "int4" and any(GGUF_WEIGHT_DTYPES[t] == "int8" for t in mapped) else None
    shown = ", ".join(f"{n} {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))
    return body, head, f"the GGUF stores its matrices as {main} ({shown})"


def gguf_file(model_dir: Path) -> Path | None:
    """The GGUF a store model keeps its weights in (pulled from a .gguf), or None for a checkpoint dir."""
    from mlc.models.gguf.convert import GGUF_FILE

    path = model_dir / GGUF_FILE
    return path if path.is_file() else None


def _load_gguf(net: CausalLM, path: Path, model_dir: Path, serve_codes: bool):
    """Weights from the GGUF itself: int4 matrices from their codes where `serve_codes` (the default path on the
    CPU, one rank), everything else dequantized into the float parameters. Returns what became of them."""
    import json

    from mlc.models.gguf.convert import iter_hf_tensors
    from mlc.models.gguf.native import ARCHITECTURES, load_gguf
    from mlc.models.gguf.reader import open_gguf_tensors

    gf = open_gguf_tensors(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    if gf.architecture in ARCHITECTURES:
        return load_gguf(net, gf, cfg, native=serve_codes and tp_size() == 1)
    with torch.no_grad():
        net.load_weights((name, torch.from_numpy(values)) for name, values in iter_hf_tensors(gf, cfg))
    return None


def _gguf_dtypes(native) -> Callable[[str], str | None]:
    """A float-loaded layer's weight dtype from its own GGUF type (a Q6_K matrix beside Q4_K ones stays 8-bit)."""
    return lambda name: GGUF_WEIGHT_DTYPES.get(native.module_types.get(name, ""))


def describe_weights(net: CausalLM) -> str:
    """One line for logs and /v1/models: what the weights run as, and why."""
    return getattr(net, "weight_info", None) or f"{str(net.dtype).removeprefix('torch.')} (checkpoint precision)"


def check_mtp_checkpoint(model_dir: Path, cfg, gguf: Path | None, compiled: bool) -> None:
    """The checkpoint holds the MTP layer that speculative method "mtp" drafts with, or a clear error says so."""
    from mlc.models.mtp import has_mtp_weights, mtp_layers_of

    fix = 'use {"method": "ngram"} (prompt lookup) for this model'
    if model_class(cfg.model_type).add_mtp is CausalLM.add_mtp:
        raise ConfigError(f"{model_dir.name}: {cfg.model_type} models have no multi-token-prediction (MTP) layer "
                          f"(GLM-4.5/4.6/4.7 and GLM-5 checkpoints do); {fix}")
    if compiled:
        raise ConfigError(f"{model_dir.name}: speculative method \"mtp\" reads the MTP layer from a safetensors or "
                          f"GGUF checkpoint; compiled models do not keep it; {fix}")
    if not mtp_layers_of(cfg):
        where = (f"its GGUF declares no nextn_predict_layers, or {model_dir} was added before mlc read NextN "
                 "layers: delete that directory and load the .gguf again" if gguf else
                 "config.json declares no num_nextn_predict_layers")
        raise ConfigError(f"{model_dir.name} has no multi-token-prediction layer ({where}); {fix}")
    if gguf is not None:
        from mlc.models.gguf.reader import open_gguf_tensors

        if f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight" not in open_gguf_tensors(gguf).tensor_names():
            raise ConfigError(f"{model_dir.name}: the GGUF declares a NextN layer but holds no "
                              f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight (converted without it?); {fix}")
        return
    if not has_mtp_weights(set(safetensors_names(safetensors_files(model_dir))), cfg):
        raise ConfigError(f"{model_dir.name}: config.json declares an MTP layer but the safetensors hold no "
                          f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight (a download without the MTP "
                          f"layer?); {fix}")


def load_model(model: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               weight_dtype: str = "auto", verify: bool = False, mtp: bool = False) -> CausalLM:
    """Resolve a store name, checkpoint dir or .gguf file, check a store model's files against its manifest
    (sampled hashes; every byte with `verify`), build its architecture and load its weights
    (then quantize them to `weight_dtype`, see mlc.layers.quant). `mtp`: its multi-token-prediction layer too
    (models/mtp.py), for speculative decoding."""
    from mlc.models.store import resolve_model_dir
    from mlc.models.store.verifying import check_at_load

    model_dir = resolve_model_dir(model)
    check_at_load(model_dir, full=verify)
    cfg = read_config(model_dir)
    dev = resolve_device(device)
    head_dtype, asked, why, cast_after = None, weight_dtype, "", None
    source = source_weight_dtypes(model_dir) if weight_dtype == "auto" and not is_compiled(model_dir) else None
    if source is not None and dev.type == "cpu":  # elsewhere the quantized layers run their slow reference path
        weight_dtype, head_dtype, why = source
        if weight_dtype in ("int4", "int8") and dtype in (None, "auto") and cpu_has_native_bf16():
            # the int4 and int8 (W8A16) kernels take bf16 activations: no conversion around every matmul. Weights are
            # quantized from fp32 first, then what stays float (embedding, norms) is cast
            cast_after = torch.bfloat16
            why += "; activations in bf16, which this CPU computes natively"
    dt = resolve_dtype(dtype, dev, getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None))
    gguf = gguf_file(model_dir)
    if mtp:
        check_mtp_checkpoint(model_dir, cfg, gguf, is_compiled(model_dir))
    net = build_model(cfg, dev, dt, mtp)  # its float parameters are allocated, never written where codes serve a layer
    native = None
    if is_compiled(model_dir):
        weight_dtype = _load_compiled(net, model_dir, weight_dtype)
        net.weight_info = f"as compiled ({read_compiled_manifest(model_dir)['options']['weight_dtype']})"
    elif gguf is not None:
        native = _load_gguf(net, gguf, model_dir, serve_codes=source is not None and dev.type == "cpu")
    else:
        with torch.no_grad():
            net.load_weights(iter_safetensors(safetensors_files(model_dir)))
    if weight_dtype != "auto":
        from mlc.layers.quant import quantize_model

        # the default path: W8A16 in the body (bf16 activations, as the int4 layers take them) and W8A8 (C++, fbgemm) in
        # the head, 2.5-5x faster there; both keep a request's output independent of its batch
        scheme = "w8a16" if asked == "auto" else "mixed"
        per_layer = _gguf_dtypes(native) if native is not None else None
        if isinstance(net.lm_head, QuantizedLinear):
            head_dtype = None  # served from the GGUF's own blocks already
        elif head_dtype:
            why += "; the head keeps 8 bits as the GGUF does"
        net.quant_report = quantize_model(net, weight_dtype, int8_scheme=scheme, head_dtype=head_dtype,
                                          head_int8_scheme="w8a8" if asked == "auto" else None,
                                          weight_dtype_for=per_layer)
        head = f", head {head_dtype}" if head_dtype else ""
        body = weight_dtype
        if native is not None and native.layers:
            from mlc.models.gguf.native import describe

            body = describe(native)
        net.weight_info = (f"{body}{head} (default: {why}; --weight-dtype fp32 for full precision)"
                           if asked == "auto" else f"{weight_dtype} (--weight-dtype)")
    if cast_after is not None:
        net.to(cast_after)
    net.model_dir = model_dir
    return net
