"""Reading a `mlc-cli compile` output: its manifest, its files' hashes, and its quantized layers rebuilt from codes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlc.errors import IntegrityError, ModelFormatError

COMPILED_MANIFEST = "mlc_compiled.json"
FORMAT_VERSION = 2  # 2: int4 layers hold fp16 (scale, offset) pairs, w = q * scale + offset
WEIGHTS_FILE = "model.safetensors"


def is_compiled(model_dir: Path) -> bool:
    return (Path(model_dir) / COMPILED_MANIFEST).is_file()


def read_compiled_manifest(model_dir: Path) -> dict:
    path = Path(model_dir) / COMPILED_MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path} is unreadable ({e}); compile the model again") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelFormatError(f"{model_dir} was compiled in format {manifest.get('format_version')}, this mlc reads "
                               f"{FORMAT_VERSION}; compile it again with this version")
    return manifest


def verify_compiled(model_dir: Path) -> list[str]:
    """Files whose sha256 differs from the manifest (or are missing); a name leading outside raises IntegrityError."""
    from mlc.models.store.integrity import confined_path, sha256_file

    manifest = read_compiled_manifest(model_dir)
    bad = []
    for name, rec in manifest["files"].items():
        path = confined_path(Path(model_dir), name)
        if not path.is_file() or sha256_file(path) != rec["sha256"]:
            bad.append(name)
    return bad


def install_quantized_layers(net, model_dir: Path, manifest: dict) -> None:
    """Replace the layers the manifest lists with quantized ones built from their stored codes."""
    from safetensors import safe_open

    from mlc.layers.quant import _swap
    from mlc.layers.quant_linear import HalfLinear, Int4Linear, Int8Linear, QuantizedLinear

    device = net.device
    with safe_open(str(Path(model_dir) / WEIGHTS_FILE), framework="pt", device=str(device)) as f:
        for name, rec in manifest["quantized_layers"].items():
            # cloned: packed kernel weights may keep pointing at their input, and the file mapping closes below
            codes = {k: f.get_tensor(f"{name}.{k}").clone() for k in _code_names(rec)}
            bias = codes.pop("bias", None)
            shape = torch.empty(rec["out_features"], rec["in_features"], device="meta")
            shards = rec["shard_sizes"] if len(rec["shard_sizes"]) > 1 else None
            kind = rec["kind"]
            layer: QuantizedLinear
            if kind == "int8":
                layer = Int8Linear(shape, bias, shards, scheme=rec["scheme"], codes=codes)
            elif kind == "int4":
                layer = Int4Linear(shape, bias, shards, group_size=rec["group_size"], codes=codes)
            else:
                layer = HalfLinear(shape, bias, shards, dtype=getattr(torch, kind), codes=codes)
            if name == "lm_head":
                net.lm_head = layer
            else:
                _swap(net, name, layer)


def _code_names(rec: dict) -> list[str]:
    names = {"int8": ["qweight", "scale"], "int4": ["qweight", "scale_offsets"]}.get(rec["kind"], ["weight_half"])
    return names + (["bias"] if rec["bias"] else [])
