"""`mlc-cli compile`: fused, padded, quantized dirs that load to exactly the outputs of the runtime path."""

from __future__ import annotations

import json

import pytest
import torch

from mlc.errors import ConfigError
from mlc.models.compile import COMPILED_MANIFEST, compile_model, verify_compiled
from mlc.models.loader import load_model
from tests.support.tiny_llama import build_tiny_llama

IDS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("compile") / "base")


@pytest.mark.parametrize("weight_dtype", ["auto", "fp16", "int8", "int4"])
def test_compiled_outputs_equal_the_runtime_path(base, tmp_path, weight_dtype):
    out = tmp_path / "out"
    res = compile_model(base, out, weight_dtype, alignment=48)
    assert res.padded_intermediate == (64, 96)
    assert (res.quantized_layers > 0) == (weight_dtype != "auto")
    ours = load_model(str(base), weight_dtype=weight_dtype).dense_logits(IDS)
    compiled = load_model(str(out)).dense_logits(IDS)
    for a, b in zip(ours, compiled):
        assert torch.equal(a, b)


def test_padding_is_exact_and_recorded(base, tmp_path):
    out = tmp_path / "out"
    compile_model(base, out, "auto", alignment=48)
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 96
    manifest = json.loads((out / COMPILED_MANIFEST).read_text())
    assert manifest["options"]["padded_intermediate"] == [64, 96]
    assert "model.safetensors" in manifest["files"] and "tokenizer.json" in manifest["files"]
    plain = load_model(str(base)).dense_logits(IDS)
    padded = load_model(str(out)).dense_logits(IDS)
    for a, b in zip(plain, padded):
        assert (a - b).abs().max().item() < 1e-5


def test_verify_names_a_corrupted_file_and_bad_options_are_refused(base, tmp_path):
    out = tmp_path / "out"
    compile_model(base, out, "int8")
    assert verify_compiled(out) == []
    with open(out / "tokenizer.json", "r+b") as f:
        f.seek(10)
        f.write(b"#")
    assert verify_compiled(out) == ["tokenizer.json"]
    with pytest.raises(ConfigError, match="not empty"):
        compile_model(base, out, "int8")
    with pytest.raises(ConfigError, match="compiled with weight_dtype int8"):
        load_model(str(out), weight_dtype="int4")
