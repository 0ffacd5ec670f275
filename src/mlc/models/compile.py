"""`mlc-cli compile`: the offline step that turns an HF checkpoint into the engine's own layout.

A compiled dir holds q|k|v and gate|up already fused (our parameter names), the dense MLP's intermediate size padded
with zeros to the hardware profile's alignment (exact: padded gate and up rows are zero, so silu(0) * 0 adds
nothing), quantized layers as their portable codes (int8 + scales, packed int4 + scales/zeros, fp16/bf16), the
tokenizer and generation files, and `mlc_compiled.json` (options, source, sha256 of every file). Loading it skips
fusing and quantizing; the codes are the ones `--weight-dtype` would compute at load time, so outputs are identical.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from mlc.errors import ConfigError, ModelFormatError

# the reading side that callers of the compile step import from here
from mlc.models.compiled import (
    COMPILED_MANIFEST,
    FORMAT_VERSION,
    WEIGHTS_FILE,
    is_compiled,
    verify_compiled,  # noqa: F401 (re-exported)
)

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "chat_template.jinja", "tokenizer.model")
_MLP = re.compile(r"layers\.\d+\.mlp\.(gate_up_proj|down_proj)\.(weight|bias)$")


@dataclass
class CompileResult:
    out_dir: Path
    weight_dtype: str
    padded_intermediate: tuple[int, int] | None  # (from, to)
    quantized_layers: int
    bytes_written: int


def _padded(size: int, align: int) -> int:
    return size if align <= 1 else math.ceil(size / align) * align


def _pad_mlp(state: dict[str, torch.Tensor], old: int, new: int) -> None:
    """Zero-pad every dense MLP's intermediate dim from `old` to `new` (gate and up halves separately)."""
    extra = new - old
    for key in [k for k in state if _MLP.search(k)]:
        t = state[key]
        if ".gate_up_proj." in key and t.shape[0] == 2 * old:
            gate, up = t.split(old, dim=0)
            pad = t.new_zeros((extra, *t.shape[1:]))
            state[key] = torch.cat((gate, pad, up, pad), dim=0)
        elif key.endswith("down_proj.weight") and t.shape[1] == old:
            state[key] = torch.cat((t, t.new_zeros(t.shape[0], extra)), dim=1)


def _codes(module) -> tuple[dict, dict[str, torch.Tensor]]:
    """A reference-path quantized layer's record and its portable tensors."""
    from mlc.layers.quant_linear import HalfLinear, Int4Linear, Int8Linear

    record = {"in_features": module.in_features, "out_features": module.out_features,
              "shard_sizes": module.shard_sizes, "bias": module.bias is not None}
    if isinstance(module, Int8Linear):
        assert module.scale is not None  # the reference path keeps its scales apart from the codes
        record.update(kind="int8", scheme=module.scheme)
        tensors = {"qweight": module.qweight, "scale": module.scale.float()}
    elif isinstance(module, Int4Linear):
        assert module.scale_offsets is not None  # the reference path keeps its scales apart from the codes
        record.update(kind="int4", group_size=module.group_size)
        tensors = {"qweight": module.qweight, "scale_offsets": module.scale_offsets}
    elif isinstance(module, HalfLinear):
        record.update(kind=str(module.storage_dtype).removeprefix("torch."))
        tensors = {"weight_half": module.weight_half}
    else:
        raise ModelFormatError(f"{type(module).__name__} layers cannot be compiled yet")
    if module.bias is not None:
        tensors["bias"] = module.bias
    return record, tensors


def compile_model(model: str | Path, out_dir: Path, weight_dtype: str = "auto", group_size: int = 32,
                  int8_scheme: str = "mixed", alignment: int = 1, overwrite: bool = False,
                  source_note: dict | None = None, progress=None) -> CompileResult:
    """`progress(done, total, what)`: loading, then one step per layer quantized, then writing."""
    from safetensors.torch import save_file

    from mlc.layers.quant import quantize_model
    from mlc.layers.quant_linear import QuantizedLinear
    from mlc.layers.quant_moe import QuantizedExperts
    from mlc.models.hf_checkpoint import build_model, checkpoint_tensors, read_config
    from mlc.models.store import resolve_model_dir
    from mlc.models.store.manifest import file_records
    from mlc.models.store.verifying import check_at_load

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} exists and is not empty; pass --overwrite or choose another --out")
    src = resolve_model_dir(model)
    check_at_load(src)
    if is_compiled(src):
        raise ConfigError(f"{src} is already compiled; compile the HF checkpoint it came from")
    say = progress or (lambda *_: None)
    say(0, 1, "loading weights")
    cfg = read_config(src)
    net = build_model(cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        net.load_weights(checkpoint_tensors(src))
    state = {k: v for k, v in net.state_dict().items() if not (net.tied and k == "lm_head.weight")}
    padded = None
    old = getattr(cfg, "intermediate_size", None)
    if old and _padded(old, alignment) != old:
        new = _padded(old, alignment)
        _pad_mlp(state, old, new)
        cfg.intermediate_size = new
        padded = (old, new)
        net = build_model(cfg, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            net.load_weights(state.items())
    layers: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    if weight_dtype != "auto":
        say(0, 1, f"quantizing to {weight_dtype}")
        quantize_model(net, weight_dtype, group_size, int8_scheme, use_kernels=False)  # portable codes
        modules = list(net.named_modules())
        for done, (name, module) in enumerate(modules, start=1):
            if isinstance(module, QuantizedExperts):
                raise ModelFormatError("compiling quantized MoE experts is not supported yet; compile with "
                                       "--weight-dtype auto and quantize at load time")
            if isinstance(module, QuantizedLinear):
                say(done, len(modules) + 1, f"packing {name}")
                layers[name], codes = _codes(module)
                tensors.update({f"{name}.{k}": v.contiguous() for k, v in codes.items()})
    quantized = tuple(f"{n}." for n in layers)
    for key, value in net.state_dict().items():
        if key.startswith(quantized) or (net.tied and key == "lm_head.weight"):
            continue
        tensors[key] = value.contiguous()
    say(1, 1, "writing")
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.exists() else None) as tmp:
        stage = Path(tmp) / "compiled"
        stage.mkdir()
        save_file(tensors, str(stage / WEIGHTS_FILE), metadata={"format": "pt", "mlc_compiled": str(FORMAT_VERSION)})
        cfg.to_json_file(str(stage / "config.json"))
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, stage / name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "compiled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": {"model": str(model), "dir": str(src), **(source_note or {})},
            "options": {"weight_dtype": weight_dtype, "group_size": group_size, "int8_scheme": int8_scheme,
                        "alignment": alignment, "fused": ["qkv_proj", "gate_up_proj"],
                        "padded_intermediate": padded},
            "quantized_layers": layers,
            "files": file_records(stage),
        }
        (stage / COMPILED_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(stage), str(out_dir))
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    return CompileResult(out_dir, weight_dtype, padded, len(layers), size)
