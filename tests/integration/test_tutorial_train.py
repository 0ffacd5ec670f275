"""The reference tutorial's training steps (4.3) end to end on a tiny model, each line given to `mlc-cli` as written:
`preprocess.py`'s flags with a tokenizer-only directory, then `run_mindformer.py`'s flags with the tutorial's
glm5_7b_lora.yaml, whose `parallel_config.data_parallel: 2` starts two processes (model_parallel is 1 here, so that
the run fits two cores; tests/integration/test_train_tensor_parallel.py runs model_parallel: 2). The environment is
the tutorial's too: train.sh's BATCH_SIZE=8 and SEQ_LEN=2048, and the 4-card launch's HCCL_* and RANK_SIZE (2 here,
the processes this run starts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_llama import build_tiny_llama
from tests.support.tutorial_text import GLM5_7B_LORA_YAML

LORA_YAML = GLM5_7B_LORA_YAML.replace("model_parallel: 2", "model_parallel: 1")  # two processes, not four
ROW = {"instruction": "用户说'订单没收到'，应如何回复？", "output": "您好，已为您查询订单状态..."}


TUTORIAL_TRAIN_ENV = {"BATCH_SIZE": "8", "SEQ_LEN": "2048", "HCCL_WHITELIST_DISABLE": "1", "HCCL_OVER_DUMP": "0",
                      "RANK_SIZE": "2", "RANK_ID": "0"}


def mlc(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "mlc.cli.main", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_preprocess_then_train_with_the_tutorials_flags(tmp_path):
    build_tiny_llama(tmp_path / "models/glm5-7b")
    (tmp_path / "models/glm5-tokenizer").mkdir()  # the model's tokenizer files alone, as the tutorial ships them
    for f in (tmp_path / "models/glm5-7b").iterdir():
        if f.name != "config.json" and f.suffix != ".safetensors" and not f.name.startswith("generation"):
            shutil.copy(f, tmp_path / "models/glm5-tokenizer" / f.name)
    (tmp_path / "data").mkdir()
    rows = [ROW] + [{"instruction": f"{ROW['instruction']} #{i}", "output": ROW["output"]} for i in range(15)]
    (tmp_path / "data/qa_data.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                                 encoding="utf-8")
    (tmp_path / "configs/glm5").mkdir(parents=True)
    (tmp_path / "configs/glm5/glm5_7b_lora.yaml").write_text(LORA_YAML, encoding="utf-8")

    pre = mlc(tmp_path, "preprocess", "--input_file=data/qa_data.jsonl", "--output_file=data/qa_processed.bin",
              "--tokenizer_path=models/glm5-tokenizer/", "--max_seq_len=2048", "--pad_to_multiple_of=16")
    assert pre.returncode == 0, pre.stderr
    train = mlc(tmp_path, "train", "--config=configs/glm5/glm5_7b_lora.yaml", "--run_mode=train",
                "--device_target=CPU", "--distribute=True", "--use_parallel=True",
                f"--data_url={tmp_path}/data/qa_processed.bin", f"--ckpt_url={tmp_path}/models/glm5-7b",
                f"--output_dir={tmp_path}/output/lora_finetune", "max_steps=2", "data.eval=null", "--quiet",
                env=TUTORIAL_TRAIN_ENV)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "note: --data_url" in train.stderr and "parallel_config.data_parallel -> nproc" in train.stderr
    assert "SEQ_LEN=2048 -> max_seq_len: 2048" in train.stderr and "BATCH_SIZE=8 -> batch_size: 8" in train.stderr
    log = [json.loads(line) for line in (tmp_path / "output/lora_finetune/train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert [r["epoch"] for r in steps] == [1.0, 2.0]  # 16 rows, 16 a step: BATCH_SIZE 8 x 2 processes
    assert (tmp_path / "output/lora_finetune/adapter/adapter_config.json").is_file()
