"""The whole loop on the default model: train the shipped LoRA config, then serve the adapter through the engine;
held-out questions get the trained style (greeting and sign-off) and the base model's answers do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlc.config.loader import load_train_config
from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.train.run import RunOptions, train

ROOT = Path(__file__).resolve().parents[2]
GREETINGS = ("Hello, thank you for contacting Lumen Support!", "您好，感谢您联系Lumen客服！")


@pytest.mark.slow
def test_trained_adapter_answers_held_out_questions_in_style(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's data paths are relative to the repo root
    cfg = load_train_config(ROOT / "configs" / "lora_smollm2.yaml", [f"output_dir={tmp_path / 'run'}"])
    result = train(cfg, RunOptions(fresh=True, progress=False))
    assert result.eval_loss_after < result.eval_loss_before - 0.5
    llm = LLM(str(default_model_dir), lora_adapters={"support": result.adapter_dir}, weight_dtype="fp32")
    rows = [json.loads(line) for line in (ROOT / "data" / "customer_service_eval.jsonl").read_text().splitlines()]
    questions = [r["instruction"] for r in rows[:6]]
    greedy = SamplingParams(max_new_tokens=48, temperature=0.0)
    for adapter in (0, 1):
        for i, q in enumerate(questions):
            llm.engine.add_request(f"{adapter}-{i}", llm.render_chat([{"role": "user", "content": q}]), greedy,
                                   adapter_id=adapter)
    texts = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    tuned = sum(texts[f"1-{i}"].startswith(GREETINGS) for i in range(len(questions)))
    base = sum(texts[f"0-{i}"].startswith(GREETINGS) for i in range(len(questions)))
    assert tuned >= len(questions) - 1 and base == 0, texts
