"""Weight quantization: per-kernel error bounds against the fp32 matmul, the reference path (devices without the CPU
kernels), MergedLinear splits, freed float weights, a quantized tiny Llama and tiny MoE model against fp32, the
engine flag, and `bench quant`'s parsing and registration."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from mlc.errors import ConfigError, ModelFormatError
from mlc.layers import quant_kernels as qk
from mlc.layers import quant_linear
from mlc.layers.linear import MergedLinear
from mlc.layers.quant import quantize_model, weight_bytes
from mlc.layers.quant_linear import HalfLinear, Int4Linear, Int8Linear, QuantizedLinear
from mlc.layers.quant_moe import QuantizedExperts
from mlc.models.loader import load_model
from tests.support.tiny_llama import build_tiny_llama

# relative error bounds vs the fp32 layer on N(0, 1) inputs, N(0, 0.05) weights (quant_linear's docstring)
BOUNDS = {"int8-w8a16": 0.01, "int8-w8a8": 0.025, "int8-w8a8i": 0.025, "int4-g32": 0.12, "int4-g64": 0.12,
          "fp16": 1e-3, "bf16": 0.01}
LAYERS = {
    "int8-w8a16": lambda w, b, k: Int8Linear(w, b, scheme="w8a16", use_kernels=k),
    "int8-w8a8": lambda w, b, k: Int8Linear(w, b, scheme="w8a8", use_kernels=k),
    "int8-w8a8i": lambda w, b, k: Int8Linear(w, b, scheme="w8a8i", use_kernels=k),
    "int4-g32": lambda w, b, k: Int4Linear(w, b, group_size=32, use_kernels=k),
    "int4-g64": lambda w, b, k: Int4Linear(w, b, group_size=64, use_kernels=k),
    "fp16": lambda w, b, k: HalfLinear(w, b, dtype=torch.float16, use_kernels=k),
    "bf16": lambda w, b, k: HalfLinear(w, b, dtype=torch.bfloat16, use_kernels=k),
}

KERNEL_PROBES = {
    "int8-w8a16": qk.has_int8pack, "int8-w8a8": qk.has_fbgemm_int8, "int8-w8a8i": qk.has_int_mm,
    "int4-g32": qk.has_int4pack, "int4-g64": qk.has_int4pack, "fp16": qk.has_fbgemm_fp16, "bf16": lambda: True,
}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def weight():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(96, 128, generator=gen) * 0.05, torch.randn(96, generator=gen) * 0.1


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("batch", [1, 8])
def test_error_within_bound(weight, kind, use_kernels, batch):
    w, b = weight
    layer = LAYERS[kind](w, b, use_kernels)
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, w, b)
    assert rel_err(layer(x), ref) < BOUNDS[kind]
    assert layer(x[None]).shape == (1, batch, 96)  # leading dims pass through
    if not use_kernels:
        assert layer.kernel == "reference"


@pytest.mark.parametrize("kind", list(LAYERS))
def test_kernel_and_reference_agree(weight, kind):
    """The CPU kernel multiplies by the weight the reference path dequantizes (up to bf16 activation rounding)."""
    w, b = weight
    kernel, reference = LAYERS[kind](w, b, True), LAYERS[kind](w, b, False)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    # a torch build without the kernel must fall back to the reference path, and then computes exactly that
    assert (kernel.kernel != "reference") == KERNEL_PROBES[kind]()
    if kernel.kernel == "reference":
        assert torch.equal(kernel(x), reference(x))
        return
    assert rel_err(kernel(x), reference(x)) < (0.012 if kind.startswith("int8-w8a8") else 0.006)
    assert rel_err(kernel.dequantized(), reference.dequantized()) < 0.005


def test_w8a8_scales_activations_per_token(weight):
    """One huge-activation token in the batch must not flatten the others (fbgemm quantizes per call)."""
    w, _ = weight
    layer = Int8Linear(w, scheme="w8a8")
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    x[0] *= 200.0
    y = layer(x)
    for row in range(4):
        assert rel_err(y[row], F.linear(x[row], w)) < BOUNDS["int8-w8a8"]


@pytest.mark.parametrize("scheme,kernel,available", [
    ("w8a8", "mlc-int8", lambda: quant_linear.cpu_op("int8_linear") is not None),
    ("w8a8", "fbgemm-w8a8", qk.has_fbgemm_int8),
    ("w8a8i", "int_mm-w8a8", qk.has_int_mm)])
def test_integer_w8a8_rows_do_not_depend_on_the_batch(weight, scheme, kernel, available, monkeypatch):
    """w8a8 (the default path's head; the C++ kernel, or fbgemm without it) and w8a8i: each row is quantized with its
    own scales (fbgemm's range pinned to [-1, 1]) and summed exactly in int32, so a row gives bit-identical output
    alone and next to a huge-activation row, whatever the sign of each row's largest value."""
    if kernel == "fbgemm-w8a8":
        monkeypatch.setattr(quant_linear, "cpu_op", lambda name: None)  # as where the C++ kernels are not built
    w, b = weight
    layer = Int8Linear(w, b, scheme=scheme)
    assert layer.kernel == (kernel if available() else "reference")
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    x[0] *= 500.0
    x[1] = x[1].abs()  # its range is [0, max]: fbgemm alone would quantize it on a different grid
    together = layer(x)
    for row in range(6):
        assert torch.equal(layer(x[row : row + 1])[0], together[row])
        assert torch.equal(layer(x[[row, 0]])[0], together[row])
        assert rel_err(together[row], F.linear(x[row], w, b)) < BOUNDS[f"int8-{scheme}"]
    assert torch.allclose(layer.dequantized(), w, atol=w.abs().max().item() / 100)  # the pinning columns are not in it


def test_int4_roundtrip_layout():
    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    assert torch.equal(qk.unpack_int4(qk.pack_int4(q)), q.to(torch.uint8))
    w = torch.randn(16, 64)
    q, sz = qk.quantize_int4(w, 32)
    assert sz.shape == (2, 16, 2) and int(q.min()) >= 0 and int(q.max()) <= 15
    deq = qk.dequantize_int4(qk.pack_int4(q), sz, 32, torch.float32)
    step = (w.reshape(16, 2, 32).amax(-1) - w.reshape(16, 2, 32).amin(-1)) / 15
    assert ((deq - w).abs().reshape(16, 2, 32) <= step[..., None] * 0.51 + 1e-3).all()  # half a step, fp16 scales


def test_int8_quantization_is_per_row():
    w = torch.randn(8, 32)
    w[3] *= 1000
    q, scale = qk.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (8,)
    assert rel_err(qk.dequantize_int8(q, scale, torch.float32)[0], w[0]) < 0.01  # row 3 does not widen row 0


def test_merged_linear_split_survives():
    torch.manual_seed(0)
    merged = MergedLinear(64, [32, 16, 16], bias=True)
    with torch.no_grad():
        merged.weight.normal_(0, 0.05)
        merged.bias.normal_(0, 0.1)
    x = torch.randn(3, 64)
    want = merged.split(merged(x))
    for layer in (Int8Linear(merged.weight, merged.bias, merged.shard_sizes),
                  Int4Linear(merged.weight, merged.bias, merged.shard_sizes)):
        got = layer.split(layer(x))
        assert [t.shape[-1] for t in got] == [32, 16, 16]
        for g, r in zip(got, want):
            assert rel_err(g, r) < 0.12
        with pytest.raises(ModelFormatError, match="already quantized"):
            layer.load_shard(0, "q_proj.weight", torch.zeros(32, 64), False)


def test_missing_kernels_take_the_reference_path(weight, monkeypatch):
    """As on CUDA/NPU or a torch without these ops: same results through pure torch."""
    for probe in ("has_fbgemm_int8", "has_int8pack", "has_int_mm", "has_int4pack", "has_fbgemm_fp16"):
        monkeypatch.setattr(qk, probe, lambda: False)
    monkeypatch.setattr(quant_linear, "cpu_op", lambda name: None)  # no C++ kernels built
    w, b = weight
    x = torch.randn(2, 128)
    for kind, make in LAYERS.items():
        layer = make(w, b, True)
        assert layer.kernel == ("bf16-gemm" if kind == "bf16" else "reference"), kind  # bf16 GEMM is plain torch
        assert rel_err(layer(x), F.linear(x, w, b)) < BOUNDS[kind]


def test_int4_shape_outside_kernel_falls_back():
    w = torch.randn(24, 64) * 0.05  # 24 rows: the CPU kernel needs a multiple of 16
    layer = Int4Linear(w, group_size=32)
    assert layer.kernel == "reference"
    x = torch.randn(2, 64)
    assert rel_err(layer(x), F.linear(x, w)) < BOUNDS["int4-g32"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_quant"))


@pytest.fixture(scope="module")
def tiny_fp32(tiny_dir):
    return load_model(tiny_dir)


PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [11, 12, 13], [200, 1]]


# (relative logit error, max |logit error| / logit std); measured ~0.6x these on the tiny model (random N(0, 0.2)
# weights: the worst case for int4, which also flips one of the three greedy tokens)
@pytest.mark.parametrize("weight_dtype,int8_scheme,rel_tol,max_tol", [
    ("int8", "mixed", 0.025, 0.12), ("int8", "w8a8", 0.025, 0.12), ("int8", "w8a16", 0.02, 0.08),
    ("int4", "mixed", 0.2, 1.0), ("fp16", "mixed", 1e-3, 0.005), ("bf16", "mixed", 0.01, 0.04),
])
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
def test_quantized_tiny_llama_logits_close(tiny_dir, tiny_fp32, weight_dtype, int8_scheme, rel_tol, max_tol,
                                           use_kernels):
    """Logits of a quantized model against fp32, and the greedy next token of each prompt kept (int8 and up)."""
    model = load_model(tiny_dir)
    report = quantize_model(model, weight_dtype, int8_scheme=int8_scheme, use_kernels=use_kernels)
    assert report.layers == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the (tied) head
    ref, got = tiny_fp32.dense_logits(PROMPTS), model.dense_logits(PROMPTS)
    for r, g in zip(ref, got):
        assert rel_err(g, r) < rel_tol
        assert (g - r).abs().max().item() < max_tol * r.std().item()
    if weight_dtype != "int4":
        assert [int(g[-1].argmax()) for g in got] == [int(r[-1].argmax()) for r in ref]


def test_quantize_frees_float_weights(tiny_dir):
    model = load_model(tiny_dir)
    before = weight_bytes(model)
    old = weakref.ref(model.model.layers[0].mlp.gate_up_proj.weight)
    embed = model.model.embed_tokens.weight
    quantize_model(model, "int8")
    gc.collect()
    assert old() is None  # nothing holds the replaced float weight
    params = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("proj.weight") for n in params)
    assert model.model.embed_tokens.weight is embed  # the lookup stays float
    assert isinstance(model.lm_head, QuantizedLinear) and model.dtype == torch.float32
    linear_bytes = sum(p.numel() * 4 for n, p in load_model(tiny_dir).named_parameters() if "proj" in n)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not model.lm_head]
    int8_bytes = sum(m.weight_bytes() for m in quantized)
    assert int8_bytes < linear_bytes / 3.5  # int8 plus per-row scales: ~1/4 of fp32
    assert weight_bytes(model) == before - linear_bytes + int8_bytes + model.lm_head.weight_bytes()


def test_quantize_options_are_checked(tiny_dir):
    model = load_model(tiny_dir)
    with pytest.raises(ConfigError, match="weight_dtype"):
        quantize_model(model, "int3")
    with pytest.raises(ConfigError, match="group size"):
        quantize_model(model, "int4", group_size=48)
    with pytest.raises(ConfigError, match="scheme"):
        quantize_model(model, "int8", int8_scheme="w4a4")
    assert quantize_model(model, "fp32").layers == 0  # already the compute dtype
    assert quantize_model(model, "auto").layers == 0
    half = load_model(tiny_dir, dtype="bf16")
    with pytest.raises(ConfigError, match="wider"):
        quantize_model(half, "fp32")


def test_int4_group_that_does_not_divide_keeps_float(tiny_dir):
    model = load_model(tiny_dir)  # hidden 32: a group of 64 divides no input width but the MLP's (64)
    report = quantize_model(model, "int4", group_size=64)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, MergedLinear)
    assert any("qkv_proj" in k and "group size 64" in k for k in report.kept_float)


def test_moe_experts_quantized(tmp_path):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        max_position_embeddings=128)
    torch.manual_seed(0)
    Glm4MoeForCausalLM(cfg).save_pretrained(tmp_path)
    ref_model, model = load_model(tmp_path), load_model(tmp_path)
    quantize_model(model, "int8")
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, QuantizedExperts) and len(experts.gate_up) == 4
    assert experts.gate_up[0].shard_sizes == [32, 32]
    assert not isinstance(model.model.layers[1].mlp.gate, QuantizedLinear)  # the router stays float
    for r, g in zip(ref_model.dense_logits(PROMPTS), model.dense_logits(PROMPTS)):
        assert rel_err(g, r) < 0.05


def test_engine_weight_dtype(tiny_dir):
    from mlc.engine.llm import LLM
    from mlc.engine.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_dir), weight_dtype="int8", kv_cache_memory="8MiB", max_seq_len=64)
    model = llm.engine.model
    assert model.quant_report.layers == 9 and isinstance(model.lm_head, Int8Linear)
    out = llm.generate([[5, 17, 42]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bench_variants_parse():
    from mlc.bench.quant import parse_variant

    assert parse_variant("int4-g64").group_size == 64
    assert parse_variant("int8-w8a16").int8_scheme == "w8a16"
    assert parse_variant("fp16").weight_dtype == "fp16"
    for bad in ("int4-g48", "int8-w4", "fp8", "fp16-x"):
        with pytest.raises(ConfigError):
            parse_variant(bad)


def test_bench_decode_rate_counts_tokens_after_first():
    from types import SimpleNamespace

    from mlc.bench.quant import decode_rate

    def out(times):
        return SimpleNamespace(metrics=SimpleNamespace(token_times=times))

    assert decode_rate([out([0.0, 1.0, 2.0])]) == pytest.approx(1.0)
    assert decode_rate([out([1.0, 1.5, 2.0]), out([1.0, 1.5, 2.0])]) == pytest.approx(4.0)


def test_bench_quant_command_registers():
    import typer
    from typer.testing import CliRunner

    from mlc.cli.bench.quant import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    runner = CliRunner()
    help_text = runner.invoke(app, ["quant", "--help"]).output
    assert "--variants" in help_text and "--quick" in help_text
    bad = runner.invoke(app, ["quant", "--variants", "int4-g48", "--no-quality", "--no-peer"])
    assert bad.exit_code != 0 and "group size" in str(bad.exception)


def test_bench_variant_speed_on_tiny_model(tiny_dir):
    from mlc.bench.quant import parse_variant, run_variant

    result, refs = run_variant(str(tiny_dir), parse_variant("int8"), "cpu", 1, 4, 1, None, None)
    assert refs is None and result.decode_b1_tok_s > 0 and result.decode_b8_tok_s > 0
    assert result.kernels and result.weight_bytes < load_model(tiny_dir).lm_head.weight.numel() * 4 * 3
