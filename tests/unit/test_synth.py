"""`mlc-cli models synth` (`models/synth.py`): random-weight GGUFs of real shapes, in llama.cpp's names and layouts,
that our loader reads with the default model's tokenizer, its vocabulary padded to the shape's size."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlc.errors import ConfigError
from mlc.layers.gguf_linear import GGUFLinear
from mlc.models.loader import load_model
from mlc.models.synth import SHAPES, Shape, shape_for, write_synthetic
from tests.support.kernel_marks import needs_cpu_kernels

TINY_LLAMA = dataclasses.replace(SHAPES["llama-1B"], hidden=256, layers=2, heads=4, kv_heads=2, ffn=512,
                                 vocab=49152 + 16)
TINY_GLM4 = dataclasses.replace(SHAPES["glm4-1.5B"], hidden=256, layers=2, heads=2, kv_heads=1, ffn=512,
                                vocab=49152 + 32)
TINY_GLM4MOE = dataclasses.replace(SHAPES["glm4moe-2B"], hidden=256, layers=3, heads=2, kv_heads=1, ffn=512,
                                   vocab=49152 + 32, experts=4, moe_ffn=256)


def test_the_real_shapes_have_their_sizes():
    sizes = {k: round(s.params() / 1e9, 2) for k, s in SHAPES.items()}
    assert sizes["llama-135M"] == 0.13 and sizes["llama-1B"] == 1.24 and sizes["llama-3B"] == 3.21
    assert sizes["llama-8B"] == 8.03 and sizes["glm4-9B"] == 9.4
    assert sizes["glm4moe-2B"] == 2.49 and round(SHAPES["glm4moe-2B"].params(active=True) / 1e9, 2) == 0.94
    with pytest.raises(ConfigError, match="no synthetic shape llama 2B; known: llama --size 135M"):
        shape_for("llama", "2B")


@pytest.mark.parametrize("shape", [TINY_LLAMA, TINY_GLM4, TINY_GLM4MOE], ids=["llama", "glm4", "glm4moe"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K"])
@needs_cpu_kernels  # the gguf kernel serves the blocks
def test_a_synthetic_file_loads_and_runs(shape: Shape, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    path = write_synthetic(shape, kind, tmp_path / "m.gguf")
    model = load_model(str(path), dtype="float32")
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (shape.hidden, shape.layers, shape.vocab)
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(m.kernel == f"gguf-{kind}" for m in layers)
    logits = model.dense_logits([[1, 2, 3, 4]])[0]
    assert logits.shape == (4, shape.vocab) and torch.isfinite(logits).all()


def test_k_quants_need_whole_super_blocks(tmp_path):
    with pytest.raises(ConfigError, match="Q4_K needs rows of whole 256-value super-blocks; hidden size 576"):
        write_synthetic(SHAPES["llama-135M"], "Q4_K", tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="--quant Q4_K_M cannot be written directly"):
        write_synthetic(SHAPES["llama-135M"], "Q4_K_M", tmp_path / "x.gguf")


def test_a_moe_token_reads_its_routed_share_of_the_experts(tmp_path):
    """`bench compare`'s bandwidth figure counts top_k of the stacked experts, every other matrix whole."""
    from mlc.bench.gguf_source import bytes_per_token
    from mlc.models.gguf.reader import open_gguf_tensors

    path = write_synthetic(TINY_GLM4MOE, "Q8_0", tmp_path / "m.gguf")
    tensors = open_gguf_tensors(path).reader.tensors
    stacks = sum(t.data.nbytes for t in tensors if "_exps." in t.name)
    rest = sum(t.data.nbytes for t in tensors if len(t.shape) == 2)  # untied: the embedding is only looked up
    embedding = next(t.data.nbytes for t in tensors if t.name == "token_embd.weight")
    assert stacks and bytes_per_token(path) == rest - embedding + stacks * 2 // 4
