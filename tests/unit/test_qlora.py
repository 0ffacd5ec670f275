"""QLoRA (`train/qlora.py`): 4-bit groups round-trip within half a step, the frozen 4-bit layer's forward and input
gradient are those of its dequantized weight (no weight gradient, bf16 under autocast), and a PEFT model's decoder
is stored at under 0.3x its bf16 bytes with only the adapter trainable, training and scoring close to the bf16 base."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlc.config.loader import validate_train_config
from mlc.config.train_config import LoraSection
from mlc.errors import ConfigError
from mlc.train.model import attach_lora, load_base_model
from mlc.train.qlora import GROUP, Linear4bit, dequantize_4bit, quantize_4bit, quantize_base
from tests.support.tiny_llama import build_tiny_llama


def test_groups_round_trip_within_half_a_step():
    w = torch.randn(8, 4 * GROUP) * torch.linspace(0.1, 3.0, 8)[:, None]
    packed, scale, lo = quantize_4bit(w)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 2 * GROUP) and scale.shape == lo.shape == (8, 4)
    back = dequantize_4bit(packed, scale, lo, torch.float32)
    step = scale.float().repeat_interleave(GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 0.02 * step + 1e-6).all()  # half a step, plus bf16 stats' rounding


def test_the_4bit_layer_runs_its_dequantized_weight_forward_and_back():
    torch.manual_seed(0)
    linear = torch.nn.Linear(GROUP * 2, 24, bias=True)
    q = Linear4bit(linear)
    w = q.weight_dequantized(torch.float32)
    x = torch.randn(5, GROUP * 2, requires_grad=True)
    y = q(x)
    assert torch.allclose(y, F.linear(x, w, linear.bias), atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(x.grad, g @ w, atol=1e-5)
    assert not any(p.requires_grad for p in q.parameters())  # frozen: buffers only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert q(x).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="multiple of 64"):
        Linear4bit(torch.nn.Linear(GROUP + 8, 4))


def test_a_peft_models_decoder_is_stored_4bit_and_still_trains(tmp_path):
    model_dir = build_tiny_llama(tmp_path / "llama", hidden_size=64)
    lora = LoraSection(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    ids = torch.randint(3, 200, (2, 12))
    torch.manual_seed(0)
    full = attach_lora(load_base_model(model_dir, torch.bfloat16), lora)
    torch.manual_seed(0)
    peft = attach_lora(load_base_model(model_dir, torch.bfloat16), lora)
    stats = quantize_base(peft)
    assert stats["layers"] == 14  # 2 layers x (q, k, v, o, gate, up, down), the LoRA-wrapped ones under the adapter
    assert stats["bytes_after"] / stats["bytes_before"] < 0.3
    assert not any(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in peft.modules()
                   if m is not peft.get_base_model().lm_head)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        a, b = full(input_ids=ids).logits.float(), peft(input_ids=ids).logits.float()
    cosine = F.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cosine > 0.97  # 4-bit weights: close to the bf16 base, not equal
    loss = F.cross_entropy(peft(input_ids=ids).logits[:, :-1].float().reshape(-1, a.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    # B starts at 0, so B's gradients are the live ones; layer 0's come back through layer 1's 4-bit backward
    grads = {n: p.grad for n, p in peft.named_parameters() if "lora_B" in n}
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_the_config_takes_qlora_and_llama_factorys_quantization_bit():
    base = {"model": "m", "data": {"train": "t.jsonl"}}
    assert validate_train_config({**base, "finetuning_type": "qlora"}).finetuning_type == "qlora"
    assert validate_train_config({**base, "quantization_bit": 4, "finetuning_type": "lora"}).finetuning_type == "qlora"
    assert validate_train_config(base).finetuning_type == "lora"
    for bad, match in (({"quantization_bit": 8}, "4-bit only"), ({"finetuning_type": "full"}, "not built yet"),
                       ({"finetuning_type": "qlora", "tensor_parallel": 2}, "tensor_parallel")):
        with pytest.raises(ConfigError, match=match):
            validate_train_config({**base, **bad})


def test_a_qlora_run_trains_resumes_and_exports_an_adapter(tmp_path):
    import json

    from mlc.train.checkpoint import list_checkpoints
    from mlc.train.logging import TrainLog
    from mlc.train.run import RunOptions, train

    model_dir = build_tiny_llama(tmp_path / "llama", hidden_size=64)
    rows = [{"instruction": f"Where is order {i}?", "output": f"Order {i} ships in {i % 4 + 1} days. Thank you!"}
            for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    raw = {"model": str(model_dir), "finetuning_type": "qlora",
           "data": {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
           "optimizer": {"lr": 1e-2}, "batch_size": 4, "max_steps": 6, "max_seq_len": 64, "save_every": 3,
           "precision": "fp32", "output_dir": str(tmp_path / "run")}
    result = train(validate_train_config(raw), RunOptions(fresh=True, progress=False))
    assert result.eval_loss_after < result.eval_loss_before
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-000003", "step-000006"]
    first = {r["step"]: r["loss"] for r in TrainLog(tmp_path / "run").step_records()}
    again = train(validate_train_config({**raw, "max_steps": 8}), RunOptions(progress=False))  # resumes at 6
    assert again.resumed_from == 6 and again.steps == 8
    assert {r["step"]: r["loss"] for r in TrainLog(tmp_path / "run").step_records() if r["step"] <= 6} == first
