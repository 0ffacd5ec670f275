"""Tensor parallelism on the CPU (two gloo ranks): the same greedy tokens as one rank, and prompt logprobs within
1e-4 of transformers, for every architecture (llama with split and with replicated KV heads, glm4, glm4_moe with
experts split and spread, glm_moe_dsa), with int8 weights and with a LoRA adapter; bad sizes are refused before
any worker starts."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from mlc.distributed.state import tp_size
from mlc.engine.llm import LLM
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ConfigError, DeviceError
from mlc.layers.quant import quantize_model
from mlc.models.loader import load_model
from tests.support.tiny_glm import build_tiny_glm
from tests.support.tiny_llama import build_tiny_llama

PROMPTS = [[5, 9, 33, 70, 12, 8, 41, 17, 99, 3, 64, 21], [100, 3, 44], [7, 7, 8, 200, 31, 2, 90, 17, 5]]
TOL = 1e-4
BF16_TOL = 2e-2
KV = "4MiB"


def params(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=True, logprobs=0)


def run(llm: LLM, prompts=PROMPTS, adapter: str | None = None):
    """(generated tokens, their logprobs, prompt logprobs) per prompt."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params(), adapter_id=eng.adapter_id(adapter))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    outs = [done[f"r{i}"] for i in range(len(prompts))]
    return ([o.outputs[0].token_ids for o in outs], [[t.logprob for t in o.outputs[0].logprobs] for o in outs],
            [o.prompt_logprobs for o in outs])


def hf_prompt_logprobs(model_dir: Path, prompts=PROMPTS, peft_dir: Path | None = None) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if peft_dir is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, str(peft_dir)).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
            out.append([lp[i, p[i + 1]].item() for i in range(len(p) - 1)])
    return out


def assert_close(a: list[list[float]], b: list[list[float]], tol: float = TOL) -> None:
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        assert max((abs(u - v) for u, v in zip(x, y)), default=0.0) < tol, (x, y)


def check_parity(model_dir: Path, reference: list[list[float]] | None = None, **kw) -> None:
    one = LLM(str(model_dir), kv_cache_memory=KV, max_seq_len=256, **kw)
    tokens1, lps1, prompt1 = run(one)
    del one
    two = LLM(str(model_dir), kv_cache_memory=KV, max_seq_len=256, tensor_parallel_size=2, **kw)
    try:
        assert two.engine.tp_group is not None and tp_size() == 2
        tokens2, lps2, prompt2 = run(two)
    finally:
        two.engine.shutdown()
    assert tp_size() == 1  # the driver process is a lone process again
    assert tokens2 == tokens1
    assert_close(lps2, lps1)
    assert_close(prompt2, prompt1)
    if reference is not None:
        assert_close(prompt2, reference)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tiny llama's tokenizer for a checkpoint saved without one (the engine needs one to start)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def llama_dir(root):
    return build_tiny_llama(root / "llama")


def test_llama_tp2_matches_tp1_and_transformers(llama_dir):
    check_parity(llama_dir, hf_prompt_logprobs(llama_dir))


def test_glm4_moe_with_expert_parallel(root):
    path = build_tiny_glm(root / "glm45", moe=True)
    check_parity(path, hf_prompt_logprobs(path), enable_expert_parallel=True)


@pytest.mark.slow
def test_glm4_moe_experts_split_inside(root):
    path = build_tiny_glm(root / "glm45", moe=True)
    check_parity(path, hf_prompt_logprobs(path))


@pytest.mark.slow
def test_glm4(root):
    path = build_tiny_glm(root / "glm4", moe=False)
    check_parity(path, hf_prompt_logprobs(path))


@pytest.mark.slow
def test_llama_with_one_kv_head_replicated(root, llama_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / "llama_mqa"
    cfg = LlamaConfig.from_pretrained(str(llama_dir))
    cfg.num_key_value_heads = 1
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    copy_tokenizer(llama_dir, path)
    check_parity(path, hf_prompt_logprobs(path))


@pytest.mark.slow
def test_glm_moe_dsa(root, llama_dir):
    from tests.numerics.test_glm_moe_dsa import build_pair

    path = root / "glm5"
    build_pair(path, vocab_size=384)
    copy_tokenizer(llama_dir, path)
    check_parity(path, hf_prompt_logprobs(path), enable_expert_parallel=True)


def test_int8_weights(llama_dir):
    """Two int8 ranks against one rank quantized the same way (W8A16, whole-row scales). The CPU's W8A16 kernel
    takes bf16 activations, so a row-parallel layer's partial sums round where one rank's whole sum does not:
    logprobs agree to bf16's precision (measured 4e-3), not fp32's; the greedy tokens are the same."""
    net = load_model(str(llama_dir))
    quantize_model(net, "int8", int8_scheme="w8a16")
    tokens1, lps1, prompt1 = run(LLM(engine=LLMEngine(model=net, kv_cache_memory=KV, max_seq_len=256)))
    two = LLM(str(llama_dir), kv_cache_memory=KV, max_seq_len=256, tensor_parallel_size=2, weight_dtype="int8")
    try:
        assert "int8" in two.engine.weights
        tokens2, lps2, prompt2 = run(two)
    finally:
        two.engine.shutdown()
    assert tokens2 == tokens1
    assert_close(lps2, lps1, BF16_TOL)
    assert_close(prompt2, prompt1, BF16_TOL)


@pytest.mark.slow
def test_lora_adapter(root, llama_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    adapter = root / "adapter"
    peft.save_pretrained(str(adapter))
    reference = hf_prompt_logprobs(llama_dir, peft_dir=adapter)
    results = []
    for size in (1, 2):
        llm = LLM(str(llama_dir), kv_cache_memory=KV, max_seq_len=256, tensor_parallel_size=size,
                  lora_adapters={"a": str(adapter)})
        try:
            results.append(run(llm, adapter="a"))
        finally:
            llm.engine.shutdown()
    (tokens1, lps1, _), (tokens2, lps2, prompt2) = results
    assert tokens2 == tokens1
    assert_close(lps2, lps1)
    assert_close(prompt2, reference)


@pytest.mark.slow
def test_lora_adapter_loaded_and_unloaded_at_run_time(root, llama_dir):
    """Every rank attaches its part of an adapter loaded while serving, and detaches it on unload."""
    from mlc.bench.lora_synth import write_random_adapter

    adapter = write_random_adapter(root / "runtime_adapter", llama_dir, rank=4, seed=3, std=0.3)
    one = LLM(str(llama_dir), kv_cache_memory=KV, max_seq_len=256, lora_adapters={"a": str(adapter)})
    want = run(one, adapter="a")
    llm = LLM(str(llama_dir), kv_cache_memory=KV, max_seq_len=256, tensor_parallel_size=2)
    try:
        plain = run(llm)
        llm.engine.add_lora("a", str(adapter))
        got = run(llm, adapter="a")
        llm.engine.remove_lora("a")
        after = run(llm)
    finally:
        llm.engine.shutdown()
    assert got[0] == want[0] and got[0] != plain[0]
    assert_close(got[1], want[1])
    assert after[0] == plain[0]


def test_bad_sizes_are_refused_before_any_worker_starts(llama_dir, monkeypatch):
    import subprocess

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(subprocess, "Popen", no_workers)
    with pytest.raises(ConfigError, match=r"does not divide this model's .*number of attention heads 4.*: 1, 2, 4"):
        LLM(str(llama_dir), tensor_parallel_size=3)
    monkeypatch.setattr("mlc.distributed.checks.os.cpu_count", lambda: 2)
    with pytest.raises(DeviceError, match="larger than the 2 CPU cores available; use --tensor-parallel-size 2"):
        LLM(str(llama_dir), tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        LLM(str(llama_dir), tensor_parallel_size=2, enable_expert_parallel=True)
    net = load_model(str(llama_dir))
    with pytest.raises(ConfigError, match="pass the model's name or path"):
        LLMEngine(model=net, tensor_parallel_size=2)


def test_compile_for_two_ranks_serves_like_the_source(llama_dir, tmp_path):
    """`mlc-cli compile --tp 2` pads the MLP so each rank's slice keeps the alignment; the output, split over two
    ranks, gives the source model's greedy tokens. A size that does not divide the heads is refused up front."""
    import subprocess

    out = tmp_path / "tp2"
    cmd = [sys.executable, "-m", "mlc.cli.main", "compile", "-m", str(llama_dir), "--alignment", "48", "--tp"]
    done = subprocess.run([*cmd, "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert __import__("json").loads((out / "config.json").read_text())["intermediate_size"] == 96  # 2 x 48
    expected, _, _ = run(LLM(str(llama_dir), kv_cache_memory=KV))
    got, _, _ = run(LLM(str(out), kv_cache_memory=KV, tensor_parallel_size=2))
    assert got == expected
    refused = subprocess.run([*cmd, "3", "--out", str(tmp_path / "tp3")], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "number of attention heads 4" in refused.stderr + refused.stdout and not (tmp_path / "tp3").exists()


def test_whole_model_engines_beside_a_tensor_parallel_one(llama_dir):
    """The driver's parallel state is per engine: a one-rank engine built before or after a tensor-parallel engine
    in the same process builds whole and never waits in a collective (it used to hang in all_reduce)."""
    before = LLM(str(llama_dir), kv_cache_memory=KV)
    two = LLM(str(llama_dir), kv_cache_memory=KV, tensor_parallel_size=2)
    try:
        after = LLM(str(llama_dir), kv_cache_memory=KV)
        assert (before.engine.runner.parallel.size, two.engine.runner.parallel.size,
                after.engine.runner.parallel.size) == (1, 2, 1)
        first, second, third = run(before)[0], run(two)[0], run(after)[0]
        assert first == second == third
    finally:
        two.engine.shutdown()
    assert run(before)[0] == first and tp_size() == 1
