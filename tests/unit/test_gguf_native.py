"""A GGUF of every type the gguf kernel reads is served from its own blocks (`models/gguf/native.py`): each matrix
a GGUFLinear of its file type, the embedding looked up in the mapped file, the tied head from the same blocks; its
logits are those of the same file dequantized to fp32 within the activations' rounding; a type without a kernel
is dequantized with a log line naming its tensors; and the model generates."""

from __future__ import annotations

import logging

import pytest
import torch

from mlc.layers.gguf_linear import GGUF_KINDS, GGUFEmbedding, GGUFLinear
from mlc.layers.linear import Linear
from mlc.models.loader import load_model
from tests.support.gguf_files import write_random_llama_gguf
from tests.support.kernel_marks import CPU_KERNELS

pytestmark = CPU_KERNELS
IDS = [list(range(5, 60))]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    return tmp_path


def close(model, reference) -> None:
    ours, want = model.dense_logits(IDS)[0], reference.dense_logits(IDS)[0]
    assert ((ours - want).norm() / want.norm()).item() < 1e-4
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_every_matrix_is_served_from_its_own_blocks(kind, home):
    path = write_random_llama_gguf(home / "m.gguf", kind)
    model = load_model(str(path), dtype="float32")
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    layers = [m for m in model.modules() if isinstance(m, (Linear, GGUFLinear))]
    assert all(isinstance(m, GGUFLinear) and m.kernel == f"gguf-{kind}" for m in layers)
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    assert model.weight_info.startswith(f"the GGUF's own {kind} blocks (gguf kernel, 9 layers)")
    close(model, load_model(str(path), dtype="float32", weight_dtype="fp32"))


def test_a_mixed_file_keeps_each_tensors_type(home):
    """As llama-quantize's Q4_K_M: attn_v and ffn_down in Q6_K beside Q4_K, the embedding in Q6_K."""
    kinds = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
    path = write_random_llama_gguf(home / "m.gguf", "Q4_K", kinds=kinds)
    model = load_model(str(path), dtype="float32")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.kernel == "gguf-Q4_K+Q6_K" and mlp.down_proj.kernel == "gguf-Q6_K"
    assert model.lm_head.kernel == "gguf-Q6_K" and "head" not in model.weight_info.split("(default")[0]
    close(model, load_model(str(path), dtype="float32", weight_dtype="fp32"))


def test_a_type_without_a_kernel_is_dequantized_and_said(home, caplog):
    path = write_random_llama_gguf(home / "m.gguf", "Q4_0", kinds={"ffn_down": "Q3_K"})
    with caplog.at_level(logging.WARNING, logger="mlc.models"):
        model = load_model(str(path), dtype="float32")
    assert "2 Q3_K tensor(s) (blk.0.ffn_down.weight, blk.1.ffn_down.weight) have no native kernel here: " \
           "dequantized, then served as int4" in caplog.text
    assert model.model.layers[0].mlp.down_proj.kernel == "mlc-int4"
    assert "dequantized, then quantized: 2 Q3_K" in model.weight_info


def test_the_default_path_generates_from_the_blocks(home):
    from mlc import LLM, SamplingParams

    path = write_random_llama_gguf(home / "m.gguf", "Q5_K")
    llm = LLM(model=str(path), kv_cache_memory="8MiB", max_seq_len=128)
    assert llm.engine.weights.startswith("the GGUF's own Q5_K blocks (gguf kernel")
    out = llm.generate([IDS[0][:9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12


def test_a_tensor_with_no_place_in_the_architecture_is_a_clear_error(home):
    """A llama file carrying stacked experts (a MoE variant mlc does not read as llama) is refused by name."""
    import numpy as np

    from mlc.errors import ModelFormatError

    extra = {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 256, 256), np.float32), None)}
    path = write_random_llama_gguf(home / "m.gguf", "Q4_0", extra=extra)
    with pytest.raises(ModelFormatError, match=r"'blk.0.ffn_gate_exps.weight' has no place in a llama model"):
        load_model(str(path), dtype="float32")


def _resident_kib(root) -> int:
    """Resident KiB of this process's mappings of files under `root`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(".gguf") and str(root) in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="needs madvise (Linux)")
def test_the_files_pages_are_let_go_once_repacked(home):
    """Loading releases each matrix's mapped pages once it is repacked (the file stays in the page cache): the
    process does not hold the file and its repacked copy at once; the embedding looked up in the mapping reads its
    rows back."""
    path = write_random_llama_gguf(home / "m.gguf", "Q4_0", hidden=512, ffn=1024)
    model = load_model(str(path), dtype="float32")
    size_kib = path.stat().st_size // 1024
    assert _resident_kib(home) < size_kib // 4
    close(model, load_model(str(path), dtype="float32", weight_dtype="fp32"))
