"""The training config schema: defaults, the tutorial's spellings, overrides, and errors that name file/key/values."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlc.config.loader import load_train_config, parse_overrides, validate_train_config
from mlc.config.train_config import TrainConfig
from mlc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lora.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_template_documents_the_defaults():
    assert load_train_config(ROOT / "src/mlc/config/templates/lora.yaml") == TrainConfig()


def test_shipped_smollm2_config_is_valid():
    cfg = load_train_config(ROOT / "configs/lora_smollm2.yaml")
    assert cfg.model == "smollm2-135m-instruct"
    assert cfg.lora.resolved_target_modules() == ["q_proj", "v_proj"]
    assert cfg.max_seq_len % cfg.data.pad_to_multiple_of == 0


def test_tutorial_defaults():
    cfg = TrainConfig()
    assert (cfg.optimizer.type, cfg.optimizer.lr, cfg.optimizer.eps, cfg.optimizer.betas) == (
        "AdamW", 2e-4, 1e-6, (0.9, 0.999))
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.dtype) == (64, 64, 0.1, "float32")
    assert cfg.clip_norm == 1.0 and cfg.data.pad_to_multiple_of == 16 and cfg.train_on_prompt is False


def test_unknown_key_names_file_key_and_allowed_keys(tmp_path):
    path = write(tmp_path, "data:\n  train: x.jsonl\n  shuffle: true\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    msg = str(err.value)
    assert str(path) in msg and "data.shuffle" in msg and "unknown key" in msg
    assert "pad_to_multiple_of" in msg and "packing" in msg  # the allowed keys of that section


def test_bad_literal_lists_allowed_values(tmp_path):
    path = write(tmp_path, "lr_schedule:\n  type: polynomial\nprecision: fp8\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    msg = str(err.value)
    assert "lr_schedule.type" in msg and "cosine, linear, constant" in msg
    assert "precision" in msg and "bf16" in msg and "fp8" in msg


def test_range_and_cross_field_errors():
    with pytest.raises(ConfigError, match=r"lora\.r.*>= 1"):
        validate_train_config({"lora": {"r": 0}})
    with pytest.raises(ConfigError, match="multiple of data.pad_to_multiple_of"):
        validate_train_config({"max_seq_len": 100})
    with pytest.raises(ConfigError, match=r"optimizer\.betas"):
        validate_train_config({"optimizer": {"betas": [0.9, 1.5]}})
    with pytest.raises(ConfigError, match=r"optimizer\.type"):
        validate_train_config({"optimizer": {"type": "SGD"}})


def test_tutorial_spellings_are_accepted(tmp_path):
    path = write(tmp_path, """
optimizer:
  type: AdamWeightDecay
  learning_rate: 1.0e-4
  eps: 1.0e-6
  beta1: 0.9
  beta2: 0.95
lora_config:
  lora_r: 16
  lora_alpha: 32
  lora_dropout: 0.05
  lora_dtype: fp32
  target_modules: ["query", "key", "value", "dense"]
""")
    cfg = load_train_config(path)
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.lr == 1e-4 and cfg.optimizer.betas == (0.9, 0.95)
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.dtype) == (16, 32, 0.05, "float32")
    assert cfg.lora.resolved_target_modules() == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_alias_error_is_reported_under_the_written_key(tmp_path):
    path = write(tmp_path, "lora_config:\n  lora_r: sixteen\n")
    with pytest.raises(ConfigError, match=r"lora_config\.lora_r"):
        load_train_config(path)


def test_alias_and_key_that_disagree_are_an_error():
    with pytest.raises(ConfigError, match="disagree"):
        validate_train_config({"lora": {"r": 8}, "lora_config": {"lora_r": 16}})


def test_overrides_parse_yaml_values_and_null_unsets(tmp_path):
    path = write(tmp_path, "data:\n  train: a.jsonl\n  eval: b.jsonl\n")
    cfg = load_train_config(path, ["optimizer.lr=1e-3", "lora.target_modules=[q_proj, v_proj]", "data.eval=null"])
    assert cfg.optimizer.lr == 1e-3 and cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.data.eval is None
    assert parse_overrides(["train_on_prompt=true"]) == {"train_on_prompt": True}


def test_bad_override_is_named_as_command_line():
    with pytest.raises(ConfigError, match="not key=value"):
        load_train_config(None, ["max_steps"])
    with pytest.raises(ConfigError, match=r"max_steps \(from the command line\)"):
        load_train_config(None, ["max_steps=0"])


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ConfigError, match="config init"):
        load_train_config(tmp_path / "nope.yaml")
