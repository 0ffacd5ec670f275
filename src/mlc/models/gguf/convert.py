"""A GGUF file (llama.cpp's format) as a model dir: config.json, generation_config.json and tokenizer files beside
the GGUF itself (`gguf_into_dir`, what the store keeps: the engine reads the weights from the GGUF), or an HF
checkpoint with an fp32 model.safetensors (`convert_gguf`, for tools that read only HF checkpoints)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the reader's and the mapping's names that callers of the converter import from here
from mlc.models.gguf.dequant import (
    check_quant_types,
    dequantize_tensor,  # noqa: F401 (re-exported)
    quant_type_name,
)
from mlc.models.gguf.llama_config import generation_config, hf_config
from mlc.models.gguf.llama_tensors import (
    hf_tensor_name,  # noqa: F401 (re-exported)
    iter_hf_tensors,
    permute_rope_rows,  # noqa: F401 (re-exported)
    unpermute_rope_rows,  # noqa: F401 (re-exported)
)
from mlc.models.gguf.reader import GGUFFile, open_gguf

CONVERTER_VERSION = "2"  # 2: the store keeps the GGUF beside config.json (1 wrote an fp32 copy)
GGUF_FILE = "model.gguf"
ProgressFn = Callable[[int, int, str], None]


@dataclass
class ConversionReport:
    architecture: str
    tensor_types: dict[str, int]
    unmapped_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer_files(gf: GGUFFile, out_dir: Path) -> None:
    from mlc.models.gguf.tokenizer import build_tokenizer, special_tokens, tokenizer_config

    build_tokenizer(gf).save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(gf))
    write_json(out_dir / "special_tokens_map.json", special_tokens(gf))


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the file system allows one (no second copy on disk), else a copy."""
    import os
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def gguf_into_dir(path: str | Path, out_dir: str | Path) -> ConversionReport:
    """Write config.json, generation_config.json and the tokenizer files of `path` into `out_dir`, and put the GGUF
    there as `GGUF_FILE` (a hard link where possible): the weights stay the file's own."""
    start = time.perf_counter()
    gf = open_gguf(path)
    cfg, unmapped = hf_config(gf)
    check_quant_types(gf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(gf, out)
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", generation_config(gf))
    link_or_copy(Path(path), out / GGUF_FILE)
    types = Counter(quant_type_name(t) for t in gf.reader.tensors)
    return ConversionReport(gf.architecture, dict(types), unmapped, time.perf_counter() - start)


def convert_gguf(path: str | Path, out_dir: str | Path, progress: ProgressFn | None = None) -> ConversionReport:
    """Write an HF checkpoint dir for `path` into `out_dir` (created; existing files are overwritten)."""
    import torch
    from safetensors.torch import save_file

    start = time.perf_counter()
    gf = open_gguf(path)
    cfg, unmapped = hf_config(gf)
    check_quant_types(gf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(gf, out)
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", generation_config(gf))
    tensors: dict[str, torch.Tensor] = {}
    total = len(gf.reader.tensors)
    for i, (name, values) in enumerate(iter_hf_tensors(gf, cfg), start=1):
        tensors[name] = torch.from_numpy(values)
        if progress is not None:
            progress(i, total, name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    types = Counter(quant_type_name(t) for t in gf.reader.tensors)
    return ConversionReport(gf.architecture, dict(types), unmapped, time.perf_counter() - start)
