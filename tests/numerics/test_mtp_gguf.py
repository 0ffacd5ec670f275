"""GLM-4.5's MTP layer read from a GGUF (`{"method": "mtp"}`): llama.cpp's converter writes it as layer N (block_count
counts it) with `blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_norm}` beside a whole decoder layer. Loaded from there
it is the checkpoint's layer: the drafts are transformers' `MtpModel`'s step after step, and greedy output is the
plain engine's, in fp32 and with every matrix served from Q8_0 blocks."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from transformers import Glm4MoeForCausalLM

from mlc.engine.llm import LLM
from mlc.errors import ConfigError
from mlc.models.gguf.convert import convert_gguf
from tests.numerics.test_decode_parity import greedy
from tests.numerics.test_mtp import checked_drafts
from tests.support.kernel_marks import CPU_KERNELS
from tests.support.tiny_mtp import add_mtp_layer, reference_mtp
from tests.unit.test_gguf_glm4_moe import HF_TO_GGUF, IDS, TINY, write_tiny_glm4_moe_gguf

pytestmark = CPU_KERNELS  # loaded from the real store before a test points MLC_HOME elsewhere

MTP = {"method": "mtp"}
NEXTN = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
         "shared_head.norm.weight": "shared_head_norm"}
BATCH = [IDS[:5], IDS, [9, 200, 33, 1, 70, 70, 5]]


def gguf_nextn(checkpoint: Path, n: int) -> dict[str, np.ndarray]:
    """The MTP layer of a safetensors checkpoint (`model.layers.{n}.*`) under llama.cpp's converter's names."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    prefix = f"model.layers.{n}."
    for name, w in load_file(str(checkpoint / "model.safetensors")).items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if m := re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest):
            experts[m[2]][int(m[1])] = w
        elif rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{n}.exp_probs_b.bias"] = w
        elif rest in NEXTN:
            out[f"blk.{n}.nextn.{NEXTN[rest]}.weight"] = w
        else:
            module, suffix = rest.rsplit(".", 1)
            out[f"blk.{n}.{HF_TO_GGUF[module]}.{suffix}"] = w
    for proj, by_expert in experts.items():
        out[f"blk.{n}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A safetensors checkpoint with a random MTP layer (every tensor its own, so a tensor loaded into the wrong place
    changes the drafts), and the same model as GGUFs with that layer as their NextN layer: all fp32, and every matrix
    in Q8_0."""
    root = tmp_path_factory.mktemp("mtp-gguf")
    model = write_tiny_glm4_moe_gguf(root / "trunk.gguf", pad=16)
    convert_gguf(root / "trunk.gguf", root / "hf")
    add_mtp_layer(model, root / "hf")
    nextn = gguf_nextn(root / "hf", TINY["layers"])
    write_tiny_glm4_moe_gguf(root / "f32.gguf", pad=16, nextn=nextn)
    write_tiny_glm4_moe_gguf(root / "q8.gguf", pad=16, nextn=nextn, quant=dict.fromkeys(
        [n for n, w in nextn.items() if w.ndim >= 2 and "ffn_gate_inp" not in n] + ["output.weight"], Q.Q8_0))
    return root


def _llm(path: Path, **options) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory="8MiB", max_seq_len=128, page_size=4, **options)


def test_mtp_drafts_from_a_gguf_are_transformers_ones(files, tmp_path, monkeypatch):
    """Step after step, each draft the engine's MTP layer (read from the GGUF) leaves is the one transformers'
    `MtpModel` (read from the safetensors checkpoint) gives at that point; the output is the plain engine's."""
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    hf = Glm4MoeForCausalLM.from_pretrained(files / "hf", dtype=torch.float32).eval()
    hf.config._experts_implementation = "eager"
    plain = greedy(_llm(files / "hf"), BATCH)
    assert greedy(_llm(files / "f32.gguf", speculative_config=MTP), BATCH) == plain
    assert checked_drafts(_llm(files / "f32.gguf", speculative_config=MTP), hf, reference_mtp(hf), BATCH) > 10


def test_mtp_from_quantized_nextn_blocks_keeps_the_output(files, tmp_path, monkeypatch):
    """Every matrix of the trunk's last layer and of the NextN layer in Q8_0, served from its blocks."""
    from mlc.layers.gguf_linear import GGUFLinear

    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    plain = greedy(_llm(files / "q8.gguf"), BATCH)
    spec = _llm(files / "q8.gguf", speculative_config=MTP)
    assert isinstance(spec.engine.model.mtp.eh_proj, GGUFLinear)
    assert spec.engine.model.mtp.mlp.experts.__class__.__name__ == "QuantizedExperts"
    assert greedy(spec, BATCH) == plain and spec.engine.speculator.stats.drafted > 10


def test_a_gguf_without_its_nextn_tensors_is_refused_clearly(files, tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    write_tiny_glm4_moe_gguf(tmp_path / "cut.gguf", pad=16, drop=(f"blk.{TINY['layers']}.nextn.eh_proj.weight",))
    with pytest.raises(ConfigError, match="nextn.eh_proj"):
        _llm(tmp_path / "cut.gguf", speculative_config=MTP)
