"""PEFT LoRA adapters served by the engine: logits equal PEFT's, base and adapter requests batch together,
and a merged export gives the same greedy output as the served adapter."""

from __future__ import annotations

import pytest
import torch

from mlc.engine.llm import LLM
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ModelFormatError, ModelNotFoundError
from mlc.layers.lora import lora_rows
from mlc.models.loader import load_model
from tests.support.tiny_llama import build_tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base_dir = build_tiny_llama(root / "base")
    adapters = []
    for seed, targets in ((1, TARGETS), (2, ["q_proj", "v_proj"])):
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.3)  # B is zero after init; a trained adapter is not
        path = root / f"adapter{seed}"
        peft.save_pretrained(str(path))
        merged = root / f"merged{seed}"
        peft.merge_and_unload().save_pretrained(str(merged))
        adapters.append((path, merged, peft.eval()))
    return base_dir, adapters


@pytest.fixture(scope="module")
def llm(dirs):
    base_dir, adapters = dirs
    return LLM(str(base_dir), kv_cache_memory="8MiB",
               lora_adapters={"a1": str(adapters[0][0]), "a2": str(adapters[1][0])})


PROMPTS = [[5, 9, 33, 70, 12, 8], [100, 3, 44], [7, 7, 8, 200, 31, 2, 90, 17, 5]]


def test_adapter_logits_equal_peft(dirs, llm):
    _, adapters = dirs
    model = llm.engine.model
    for adapter_id, (_, _, peft) in enumerate(adapters, start=1):
        for prompt in PROMPTS:
            with lora_rows({adapter_id: slice(0, len(prompt))}):
                ours = model.dense_logits([prompt])[0]
            with torch.inference_mode():
                ref = peft(torch.tensor([prompt])).logits[0]
            assert (ours - ref).abs().max().item() < 1e-4


def greedy(llm, prompt, adapter=0):
    llm.engine.add_request(f"g{adapter}-{len(prompt)}-{prompt[0]}", prompt,
                           SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True), adapter_id=adapter)
    while True:
        for out in llm.engine.step():
            if out.finished:
                return out.outputs[0].token_ids


def test_base_and_adapters_batch_together(llm):
    alone = {(p_i, a): greedy(llm, p, a) for p_i, p in enumerate(PROMPTS) for a in (0, 1, 2)}
    assert alone[(0, 0)] != alone[(0, 1)]  # the adapter changes the output
    for (p_i, a) in alone:
        llm.engine.add_request(f"mix-{p_i}-{a}", PROMPTS[p_i],
                               SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True), adapter_id=a)
    done = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for (p_i, a), tokens in alone.items():
        assert done[f"mix-{p_i}-{a}"] == tokens, (p_i, a)
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.usable_pages


def test_merged_export_gives_the_served_adapter_output(dirs, llm):
    _, adapters = dirs
    for adapter_id, (_, merged, _) in enumerate(adapters, start=1):
        merged_llm = LLM(engine=LLMEngine(model=load_model(str(merged)), tokenizer=llm.engine.tokenizer,
                                          kv_cache_memory="8MiB"))
        for prompt in PROMPTS:
            assert greedy(merged_llm, prompt) == greedy(llm, prompt, adapter_id)


def test_adapter_names_and_bad_adapters(dirs, llm, tmp_path):
    assert llm.engine.adapter_id("a2") == 2 and llm.engine.adapter_id(None) == 0
    with pytest.raises(ModelNotFoundError, match="available"):
        llm.engine.adapter_id("nope")
    with pytest.raises(ModelFormatError, match="adapter_config.json"):
        llm.engine.add_lora("broken", str(tmp_path))


def test_server_selects_the_adapter_by_model_name(dirs, tmp_path):
    import httpx

    from tests.support.server_process import ServerProcess

    base_dir, adapters = dirs
    server = ServerProcess(tmp_path, ["--model", str(base_dir), "--served-model-name", "tiny",
                                      "--lora", f"support={adapters[0][0]}"])
    try:
        server.wait_healthy()
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "support"]

        def complete(model):
            body = {"model": model, "prompt": [5, 9, 33, 70], "max_tokens": 8, "temperature": 0}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=30)

        base, tuned = complete("tiny"), complete("support")
        assert base.status_code == tuned.status_code == 200
        assert tuned.json()["model"] == "support"
        assert base.json()["choices"][0]["text"] != tuned.json()["choices"][0]["text"]
        missing = complete("nope")
        assert missing.status_code == 404 and "support" in missing.json()["error"]["message"]
    finally:
        server.terminate()
