"""Hundreds of random engine schedules on a tiny random model, checked against invariants
(tests/support/engine_schedules.py); a wider seed sweep runs with the slow tests."""

from __future__ import annotations

import pytest
import torch

from mlc.config.engine_config import EngineConfig
from mlc.engine.llm_engine import LLMEngine
from tests.support.engine_schedules import sweep
from tests.support.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One tiny model with one LoRA adapter attached; a roomy reference engine runs each request alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("random-engine")
    base_dir = build_tiny_llama(root / "base")
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft.save_pretrained(str(root / "adapter"))
    base = LLMEngine(EngineConfig(model=str(base_dir)), kv_cache_memory="4MiB",
                     lora_adapters={"a1": str(root / "adapter")})
    reference = LLMEngine(base.config, model=base.model, tokenizer=base.tokenizer, lora_adapters={},
                          max_batch_size=8, enable_prefix_caching=False)
    reference.loras.loaded, reference.loras.by_id = base.loras.loaded, base.loras.by_id  # attached to the shared model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model: one thread is 3x faster than two fighting over tiny matmuls
    yield base, reference
    torch.set_num_threads(threads)


def test_random_schedules_keep_every_invariant(engines):
    totals = sweep(*engines, range(200))
    print("random engine schedules:", totals)
    assert totals["schedules"] == 200 and totals["compared_alone"] > 200
    assert totals["preemptions"] > 0 and totals["aborted"] > 0  # the sweep reaches the hard paths
    assert totals["drafts_accepted"] > 0


def test_random_schedules_with_a_draft_model_keep_every_invariant(engines):
    """The same schedules with the served model as its own draft model (so drafts are mostly accepted, but not for
    adapter requests: the draft runs without the adapter): every request is what it is alone without drafting."""
    base, reference = engines
    totals = sweep(base, reference, range(500, 530), draft=str(base.model.model_dir))
    print("random engine schedules with a draft model:", totals)
    assert totals["schedules"] == 30 and totals["compared_alone"] > 30
    assert totals["preemptions"] > 0 and totals["drafts_accepted"] > 0


@pytest.mark.slow
def test_random_schedules_wide_sweep(engines):
    totals = sweep(*engines, range(1000, 2000))
    print("random engine schedules (slow sweep):", totals)
    assert totals["schedules"] == 1000


@pytest.fixture(scope="module")
def mtp_engines(tmp_path_factory):
    """A tiny GLM-4.5 whose MTP layer repeats its last layer (drafts often accepted), and a reference engine that
    runs each request alone without drafting."""
    from transformers import Glm4MoeForCausalLM

    from tests.numerics.test_decode_parity import build_checkpoint
    from tests.support.tiny_mtp import add_mtp_layer

    path = build_checkpoint("glm4_moe", tmp_path_factory.mktemp("random-mtp"))
    add_mtp_layer(Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32), path, copy_last_layer=True)
    base = LLMEngine(EngineConfig(model=str(path), speculative_config={"method": "mtp"}), kv_cache_memory="4MiB")
    reference = LLMEngine(base.config, model=base.model, tokenizer=base.tokenizer, speculative_config=None,
                          max_batch_size=8, enable_prefix_caching=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield base, reference
    torch.set_num_threads(threads)


def test_random_schedules_with_mtp_drafts_keep_every_invariant(mtp_engines):
    """Preemption, prefix caching (a hit gives back its last page), chunked prefill, aborts, n, stops, logprobs and
    predictions, with the model's MTP layer drafting: every request is what it is alone without drafting."""
    totals = sweep(*mtp_engines, range(30), mtp=True)
    print("random engine schedules with MTP:", totals)
    assert totals["schedules"] == 30 and totals["compared_alone"] > 30
    assert totals["preemptions"] > 0 and totals["drafts_accepted"] > 0


@pytest.mark.slow
def test_random_schedules_with_mtp_drafts_wide_sweep(mtp_engines):
    totals = sweep(*mtp_engines, range(1000, 1300), mtp=True)
    print("random engine schedules with MTP (slow sweep):", totals)
    assert totals["schedules"] == 300


@pytest.mark.slow
def test_random_schedules_with_a_draft_model_wide_sweep(engines):
    base, reference = engines
    totals = sweep(base, reference, range(3000, 3200), draft=str(base.model.model_dir))
    print("random engine schedules with a draft model (slow sweep):", totals)
    assert totals["schedules"] == 200
