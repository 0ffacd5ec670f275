"""Convert a GGUF file (llama.cpp's format) into an HF checkpoint dir: config.json, generation_config.json,
tokenizer files and an fp32 model.safetensors with HF tensor names."""

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

CONVERTER_VERSION = "1"
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
