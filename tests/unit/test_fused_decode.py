"""Decode steps of a Llama, GLM-4-0414 or GLM-4.5 GGUF model run one C++ op a layer (`models/fused_decode.py`,
`csrc/decode_layer.cpp`): greedy tokens and their logprobs are bit for bit those of the eager layers, alone and in a
batch of different lengths, for a one-format file, a mixed one (a merged projection of two formats), GLM-4's layer
(qkv bias, interleaved partial rotary, sandwich norms) and GLM-4.5's (partial half-split rotary, MoE blocks with a
shared expert, routed in one group or two); the rotary kernels are the eager ops' bits; the op is
used only where it computes what the eager layers do, and a LoRA adapter or a prefill step falls back to them."""

from __future__ import annotations

import pytest
import torch

from mlc.layers.attention import build_attention_metadata
from mlc.models import fused_decode
from tests.support.gguf_files import write_random_llama_gguf
from tests.support.kernel_marks import CPU_KERNELS

pytestmark = CPU_KERNELS
PROMPTS = [list(range(5, 14)), list(range(20, 80)), [7, 8, 9]]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    return tmp_path


def _generate(llm, prompts, fused: bool, calls: list[int]):
    from mlc import SamplingParams

    model = llm.engine.runner.model
    model.decode_plans = None if fused else []  # None: built at the next decode step; []: the eager layers
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    before = len(calls)
    outs = llm.generate(prompts, params)
    ran = len(calls) - before
    return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
            for o in outs], ran


def _glm4_gguf(path):
    from gguf import GGMLQuantizationType as Q

    from tests.unit.test_gguf_glm4 import write_tiny_glm4_gguf

    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")
    write_tiny_glm4_gguf(path, quant={f"blk.{i}.{m}.weight": Q.Q8_0 for i in range(2) for m in matrices})
    return path


def _glm4moe_gguf(path, groups: int):
    """GLM-4.5's layout without q/k norms (GLM-4.5-Air's), every matrix but the router in Q8_0, the experts in
    `groups` groups of which each token's best one is searched."""
    from gguf import GGMLQuantizationType as Q

    from tests.support.gguf_files import byte_vocab
    from tests.unit.test_gguf_glm4_moe import gguf_tensors, tiny_hf_glm4_moe, write_tiny_glm4_moe_gguf

    names = gguf_tensors(tiny_hf_glm4_moe(len(byte_vocab()[0])))
    quant = {n: Q.Q8_0 for n, w in names.items() if w.ndim >= 2 and "nextn" not in n and "ffn_gate_inp" not in n}
    qk_norms = {n for n in names if "attn_q_norm" in n or "attn_k_norm" in n}
    write_tiny_glm4_moe_gguf(path, quant=quant, pad=16, drop=qk_norms,
                             extra_meta={"add_expert_group_count": groups, "add_expert_group_used_count": 1})
    return path


@pytest.mark.parametrize("file", ["Q4_0", "Q4_K+Q6_K", "glm4 Q8_0", "glm4moe Q8_0", "glm4moe Q8_0 2 groups"])
def test_fused_decode_is_the_eager_decode_bit_for_bit(file, home, monkeypatch):
    from mlc import LLM

    calls: list[int] = []
    run = fused_decode.run_layers
    monkeypatch.setattr("mlc.models.llama.run_layers", lambda *a: calls.append(1) or run(*a))
    if file == "glm4 Q8_0":
        path = _glm4_gguf(home / "m.gguf")
    elif file.startswith("glm4moe"):
        path = _glm4moe_gguf(home / "m.gguf", 2 if "groups" in file else 1)
    else:
        kinds = {"attn_v": "Q6_K", "ffn_down": "Q6_K"} if "+" in file else None
        path = write_random_llama_gguf(home / "m.gguf", file.split("+")[0], kinds=kinds)
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", max_seq_len=256)
    for prompts in ([PROMPTS[0]], PROMPTS):
        fused, ran = _generate(llm, prompts, True, calls)
        assert ran >= 39  # every decode step after the first token
        assert len(llm.engine.runner.model.decode_plans) == len(llm.engine.runner.model.model.layers)
        eager, ran = _generate(llm, prompts, False, calls)
        assert ran == 0
        assert fused == eager


def test_only_where_the_op_computes_the_eager_layer(home):
    from mlc.layers.lora import LoRALinear
    from mlc.models.loader import load_model

    path = write_random_llama_gguf(home / "m.gguf", "Q4_0")
    model = load_model(str(path), dtype="bfloat16")
    layers = model.model.layers
    plans = fused_decode.model_plans(layers, model.fusable)
    assert plans is not None and [p.dims for p in plans] == [[4, 2, 64, 0, 0, 0, 1, 1, 1, 1]] * 2
    fp32 = load_model(str(path), dtype="float32")
    assert fused_decode.model_plans(fp32.model.layers, fp32.fusable) is None  # the eager norms are not the C++ ones
    glm4 = load_model(str(_glm4_gguf(home / "glm4.gguf")), dtype="bfloat16")
    assert [p.dims for p in fused_decode.model_plans(glm4.model.layers, glm4.fusable) or []] == [
        [4, 2, 16, 1, 1, 1, 1, 1, 1, 1]] * 2  # interleaved rotary, sandwich norms, a qkv bias
    assert fused_decode.model_plans(glm4.model.layers, model.fusable) is None  # not Llama's layers
    model.decode_plans = plans
    layers[1].mlp.down_proj = LoRALinear(layers[1].mlp.down_proj)
    model.modules_changed()
    assert model.decode_plans is None
    assert fused_decode.model_plans(layers, model.fusable) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kernel", ["rope_interleaved", "rope_neox"])
def test_the_rotary_kernels_are_the_eager_ops_bits(kernel, dtype):
    """Over the whole head and over part of it (GLM's partial rotary), each kernel against its eager function."""
    from mlc.layers import rotary
    from mlc.layers.cpu_kernels import cpu_op

    gen = torch.Generator().manual_seed(0)
    for t, heads, kv, d, rot in [(1, 4, 2, 16, 8), (7, 32, 2, 128, 64), (3, 4, 2, 64, 64)]:
        qkv = torch.randn(t, (heads + 2 * kv) * d, generator=gen).to(dtype)
        angle = torch.randn(t, rot // 2, generator=gen)
        cos, sin = (torch.cat([f(angle), f(angle)], -1).to(dtype) for f in (torch.cos, torch.sin))
        eager = rotary.apply_rope_interleaved if kernel == "rope_interleaved" else rotary.apply_rope_neox
        want = eager(qkv[:, : (heads + kv) * d].view(t, heads + kv, d), cos, sin)
        assert torch.equal(cpu_op(kernel)(qkv, cos, sin, heads + kv, d), want)


def test_the_step_metadata_says_when_every_sequence_decodes_in_place():
    tables = [[1, 2], [3], [4, 5, 6]]
    all_decode = build_attention_metadata([1, 1, 1], [20, 3, 40], tables, page_size=16)
    assert len(all_decode.groups) == 2  # two length buckets, one op call over all three
    whole = all_decode.in_place_decode
    assert whole is not None and whole.tokens == slice(0, 3) and whole.context.tolist() == [20, 3, 40]
    assert torch.equal(whole.pages, torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]]))
    one = build_attention_metadata([1], [20], tables[:1], page_size=16)
    assert one.in_place_decode is one.groups[0]
    assert build_attention_metadata([1, 5], [20, 5], tables[:2], page_size=16).in_place_decode is None  # a prefill
    prefix_hit = build_attention_metadata([1, 1], [20, 3], tables[:2], page_size=16, generating=[True, False])
    assert prefix_hit.in_place_decode is None  # a prompt's last token stays on SDPA
