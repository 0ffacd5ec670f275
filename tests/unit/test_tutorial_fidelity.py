"""The reference tutorial's own lines (shared/reference/ascend-glm-tutorial.txt), each accepted as written,
translated with a note saying what it became, or refused with our equivalent. Section numbers are the tutorial's.

Lines for other tools (docker, atc, npu-smi, a mindformers checkout) are given to `mlc-cli` the way a reader of
the tutorial would: `mindie ...` becomes `mlc-cli serve ...`, `python preprocess.py ...` becomes `mlc-cli
preprocess ...`, `python run_mindformer.py ...` becomes `mlc-cli train ...`. The served end of section 4.2 (the
server, its /health and /generate, the hook) runs in tests/integration/test_tutorial_serve.py, the training chain of
4.3 in tests/integration/test_tutorial_train.py, section 6's hook line in tests/integration/test_hooks_shell.py.
The launcher of 2.3 (`mlc-cli glm5 --mode inference`) and the cluster deploy are `mlc/cli/launcher.py` and
`mlc/cli/deploy.py`, tested with them.
"""

from __future__ import annotations

import json
import shlex

import pytest
import typer

from mlc.cli.compat import translate_argv
from mlc.cli.main import _register_all, app, main
from mlc.config.ascend_env import apply_ascend_env
from mlc.config.engine_config import EngineConfig
from mlc.config.loader import load_config, load_train_config
from mlc.config.serve_config import ServeConfig
from mlc.errors import ConfigError, ModelFormatError
from mlc.models.store import resolve_model_dir
from tests.support.tiny_llama import build_tokenizer
from tests.support.tutorial_text import GLM5_7B_LORA_YAML, GLM5_INFER_YAML

# 1: "改用魔乐社区提供的 --paged-attn --kv-cache-dtype fp16 参数组合"
SECTION_1_FLAGS = "--paged-attn --kv-cache-dtype fp16"
# 2.3 (config/glm5_infer.yaml), 3.2 (attn_config) and 4.3 (glm5_7b_lora.yaml): tests/support/tutorial_text.py
# 3.4: lora_config.yaml
LORA_CONFIG_YAML = """\
lora_r: 64      # 必须16的倍数
lora_alpha: 64  # >= lora_r
lora_dtype: "float32"  # 关键！
"""
# 4.2: the MindIE server (the .om model and the flags)
MINDIE = """mindie --model=models/glm5-7b-int4.om \\
       --device_id=0 \\
       --port=8080 \\
       --max_batch_size=8 \\
       --max_seq_len=16384 \\
       --enable_paged_attention=true \\
       --kv_cache_dtype=fp16"""
# 4.3: data, preprocessing, training and its YAML
QA_ROW = '{"instruction": "用户说\'订单没收到\'，应如何回复？", "output": "您好，已为您查询订单状态..."}'
PREPROCESS = """python preprocess.py \\
  --input_file=data/qa_data.jsonl \\
  --output_file=data/qa_processed.bin \\
  --tokenizer_path=models/glm5-tokenizer/ \\
  --max_seq_len=2048 \\
  --pad_to_multiple_of=16"""
RUN_MINDFORMER = """python run_mindformer.py \\
  --config=configs/glm5/glm5_7b_lora.yaml \\
  --run_mode=train \\
  --device_target=Ascend \\
  --distribute=True \\
  --use_parallel=True \\
  --data_url=/workspace/data/qa_processed.bin \\
  --ckpt_url=/workspace/models/glm5-7b.ckpt \\
  --output_dir=/workspace/output/lora_finetune"""
# 4.4: memory variables and KV compression ("mindie启动时加")
ASCEND_ENV = {"ASCEND_ALLOC_MEM": "1", "ASCEND_MAX_MEM": "28000"}
KV_COMPRESSION = "--kv_cache_compression_ratio=0.5"


def mlc_args(line: str, tool: str, command: str) -> list[str]:
    """A tutorial command line as `mlc-cli COMMAND` arguments: `tool` replaced, line continuations joined."""
    argv = shlex.split(line.replace("\\\n", " "))
    assert argv[: len(tool.split())] == tool.split()
    return [command, *argv[len(tool.split()):]]


@pytest.fixture(scope="module")
def root():
    _register_all()
    return typer.main.get_command(app)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code or 0, capsys.readouterr().err


def test_section_1_paged_attn_flag_is_what_we_do(root):
    t = translate_argv(root, ["serve", *SECTION_1_FLAGS.split()])
    assert t.argv == ["serve", "--kv-cache-dtype", "fp16"]
    assert t.notes == ["--paged-attn -> nothing to change: the KV cache is always paged (--page-size 16 tokens a page)"]


def test_section_2_3_and_3_2_glm5_infer_yaml_is_accepted_with_notes(tmp_path):
    path = tmp_path / "glm5_infer.yaml"
    path.write_text(GLM5_INFER_YAML, encoding="utf-8")
    notes: list[str] = []
    cfg = load_config(path, ServeConfig, notes=notes)
    assert cfg.attn_implementation == "sdpa" and cfg.paged_attention is True
    assert (cfg.engine.kv_cache_dtype, cfg.engine.page_size, cfg.engine.sparse_kv.ratio) == ("fp16", 16, 0.25)
    assert f"{path}: use_paged_attn -> paged_attention" in notes
    assert f"{path}: attn_config.sparse_kv_ratio -> engine.sparse_kv.ratio" in notes
    assert f"{path}: kv_cache_dtype -> engine.kv_cache_dtype" in notes
    assert any(n.startswith(f"{path}: attn_implementation: flash -> sdpa") for n in notes)


@pytest.mark.parametrize("yaml_text,key", [
    ("use_paged_attn: False\n", "use_paged_attn (read as paged_attention)"),
    ("attn_config: {paged_attn: false}\n", "attn_config.paged_attn (read as paged_attention)"),
    ("paged_attention: false\n", "paged_attention"),
    ("attn_implementation: eager\n", "attn_implementation"),
])
def test_attention_keys_act_or_are_refused(tmp_path, yaml_text, key):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(path, ServeConfig)
    assert f"{path}: {key}:" in e.value.message and "one attention path" in e.value.message


def test_section_3_4_lora_config_yaml(tmp_path):
    path = tmp_path / "lora_config.yaml"
    path.write_text(LORA_CONFIG_YAML, encoding="utf-8")
    cfg = load_train_config(path)
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dtype) == (64, 64, "float32")


@pytest.fixture
def no_accelerator(monkeypatch):
    """This machine as the CPU-only box the tests assume, also on a GPU runner."""
    import torch

    monkeypatch.setattr("mlc.config.device.npu_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("npu,cuda,device", [(True, False, "npu:3"), (False, True, "cuda:3"), (False, False, "cpu")])
def test_device_id_picks_the_accelerator_present(root, monkeypatch, npu, cuda, device):
    import torch

    monkeypatch.setattr("mlc.config.device.npu_available", lambda: npu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert translate_argv(root, ["serve", "--device_id=3"]).argv == ["serve", "--device", device]


def test_section_4_2_mindie_flags_become_serve_flags(root, no_accelerator):
    t = translate_argv(root, mlc_args(MINDIE, "mindie", "serve"))
    assert t.argv == ["serve", "--model=models/glm5-7b-int4.om", "--device", "cpu", "--port=8080",
                      "--max-batch-size", "8", "--max-seq-len", "16384", "--kv-cache-dtype", "fp16"]
    assert "--device_id 0 -> --device cpu (no NPU or CUDA device here, so the CPU)" in t.notes
    assert "--max_batch_size=8 -> --max-batch-size 8" in t.notes
    assert any(n.startswith("--enable_paged_attention true -> nothing to change") for n in t.notes)
    params = root.commands["serve"].make_context("serve", t.argv[1:]).params  # click accepts the result
    assert (params["max_batch_size"], params["max_seq_len"], params["kv_cache_dtype"]) == (8, 16384, "fp16")


def test_section_4_2_om_model_says_what_mlc_loads_instead():
    with pytest.raises(ModelFormatError, match=r"MindIE offline model .* config.json \+ \*\.safetensors"):
        resolve_model_dir("models/glm5-7b-int4.om")


def test_section_4_2_paged_attention_cannot_be_turned_off(root):
    with pytest.raises(ConfigError, match="always paged"):
        translate_argv(root, ["serve", "--enable_paged_attention=false"])


@pytest.mark.parametrize("extra,dtype", [([], "int8"), (["--kv_cache_dtype=fp16"], "int8"),
                                         (["--kv_cache_dtype=fp32"], "fp16"), (["--kv-cache-dtype", "bf16"], "int8")])
def test_section_4_4_kv_compression_ratio_becomes_a_kv_dtype(root, extra, dtype):
    t = translate_argv(root, ["serve", *extra, KV_COMPRESSION])
    assert t.argv == ["serve", "--kv-cache-dtype", dtype]
    assert root.commands["serve"].make_context("serve", t.argv[1:]).params["kv_cache_dtype"] == dtype
    assert any(n.startswith("--kv_cache_compression_ratio 0.5") and f"--kv-cache-dtype {dtype}" in n for n in t.notes)


def test_section_4_4_other_compression_ratios(root):
    assert translate_argv(root, ["serve", "--kv_cache_compression_ratio", "0.25"]).argv[-1] == "int4"
    with pytest.raises(ConfigError, match=r"fp16 \(1.0\), int8 \(0.5\) and int4 \(0.25\)"):
        translate_argv(root, ["serve", "--kv_cache_compression_ratio=0.3"])


def test_section_4_4_ascend_memory_variables_become_the_kv_budget():
    engine = EngineConfig()
    notes = apply_ascend_env(engine, ASCEND_ENV)
    assert engine.kv_cache_memory == 28_000_000_000
    assert notes == ["ASCEND_ALLOC_MEM=1 -> nothing to change: mlc allocates the whole KV cache at start",
                     "ASCEND_MAX_MEM=28000 -> --kv-cache-memory 28000MB (the KV cache, allocated at start; the "
                     "weights come on top)"]
    given = EngineConfig(kv_cache_memory="4GiB")
    assert "not used" in apply_ascend_env(given, ASCEND_ENV)[1] and given.kv_cache_memory == 4 * 2**30
    with pytest.raises(ConfigError, match="not a number of megabytes"):
        apply_ascend_env(EngineConfig(), {"ASCEND_MAX_MEM": "28G"})


def test_section_3_3_and_4_3_training_environment():
    from mlc.config.ascend_env import apply_train_env
    from mlc.config.loader import load_train_config

    env = {"BATCH_SIZE": "8", "SEQ_LEN": "2048", "HCCL_WHITELIST_DISABLE": "1", "HCCL_OVER_DUMP": "0",
           "RANK_SIZE": "4", "RANK_ID": "0"}
    cfg, notes = apply_train_env(load_train_config(None, ["tensor_parallel=2", "nproc=2"]), env)
    assert (cfg.batch_size, cfg.max_seq_len, cfg.nproc, cfg.tensor_parallel) == (8, 2048, 2, 2)
    assert notes[:3] == ["BATCH_SIZE=8 -> batch_size: 8", "SEQ_LEN=2048 -> max_seq_len: 2048",
                         "RANK_SIZE=4 -> matches the 4 process(es) mlc starts; nothing to change"]
    assert "RANK_ID=0 -> not used" in notes[3] and notes[4].startswith("HCCL_OVER_DUMP, HCCL_WHITELIST_DISABLE ->")
    given, notes = apply_train_env(load_train_config(None, ["batch_size=2"]), {"BATCH_SIZE": "8"})
    assert given.batch_size == 2 and notes == ["BATCH_SIZE=8 -> not used: the config sets batch_size = 2"]
    with pytest.raises(ConfigError, match="RANK_SIZE=4 but this run starts 1 process"):
        apply_train_env(load_train_config(None, []), {"RANK_SIZE": "4"})
    assert apply_train_env(load_train_config(None, []), {"RANK_SIZE": "4"}, launcher=False)[1] == []
    with pytest.raises(ConfigError, match="SEQ_LEN='2k' is not a positive whole number"):
        apply_train_env(load_train_config(None, []), {"SEQ_LEN": "2k"})


def test_section_4_4_serve_config_reads_the_variables(monkeypatch):
    from mlc.cli.serve import build_config

    for name, value in ASCEND_ENV.items():
        monkeypatch.setenv(name, value)
    notes: list[str] = []
    cfg = build_config(None, {}, [], {}, notes)
    assert cfg.engine.kv_cache_memory == 28_000_000_000 and len(notes) == 2


def test_section_4_3_preprocess_line_runs_with_a_tokenizer_only_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/qa_data.jsonl").write_text(QA_ROW + "\n", encoding="utf-8")
    build_tokenizer(tmp_path / "models/glm5-tokenizer")
    assert not (tmp_path / "models/glm5-tokenizer/config.json").exists()
    code, err = run_cli(mlc_args(PREPROCESS, "python preprocess.py", "preprocess"), capsys)
    assert code == 0, err
    assert "--output_file data/qa_processed.bin -> --out data/qa_processed.bin" in err
    assert "--tokenizer_path models/glm5-tokenizer/ -> --model models/glm5-tokenizer/" in err
    stats = json.loads((tmp_path / "data/qa_processed.bin/stats.json").read_text())
    assert stats["options"]["max_seq_len"] == 2048 and stats["options"]["pad_to_multiple_of"] == 16
    assert stats["sequences"] == 1 and stats["padded_tokens"] % 16 == 0 and stats["truncated"] == 0


def test_section_4_3_lora_yaml_model_parallel_becomes_tensor_parallel(tmp_path):
    path = tmp_path / "glm5_7b_lora.yaml"
    path.write_text(GLM5_7B_LORA_YAML, encoding="utf-8")
    notes: list[str] = []
    cfg = load_train_config(path, None, notes)
    assert cfg.nproc == 2 and cfg.tensor_parallel == 2  # four processes: two copies, each split over two
    assert f"{path}: parallel_config.model_parallel -> tensor_parallel" in notes


def test_section_4_3_lora_yaml_pipeline_stages_are_refused_with_what_to_write(tmp_path):
    path = tmp_path / "glm5_7b_lora.yaml"
    path.write_text(GLM5_7B_LORA_YAML.replace("pipeline_stage: 1", "pipeline_stage: 2"), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_train_config(path)
    msg = e.value.message
    assert msg.startswith(f"{path}: parallel_config.pipeline_stage: 2: pipeline parallel training is not")
    assert "model_parallel" in msg and "data_parallel" in msg


def test_section_4_3_lora_yaml_with_one_model_copy_per_process(tmp_path):
    path = tmp_path / "glm5_7b_lora.yaml"
    path.write_text(GLM5_7B_LORA_YAML.replace("model_parallel: 2", "model_parallel: 1"), encoding="utf-8")
    notes: list[str] = []
    cfg = load_train_config(path, None, notes)
    assert cfg.nproc == 2 and cfg.optimizer.type == "AdamW" and cfg.optimizer.lr == 2e-4
    assert cfg.optimizer.betas == (0.9, 0.999) and cfg.optimizer.eps == 1e-6
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == (64, 64, 0.1)
    assert cfg.lora.resolved_target_modules() == ["q_proj", "v_proj"]
    assert f"{path}: parallel_config.data_parallel -> nproc" in notes


def test_section_4_3_run_mindformer_flags_become_train_overrides(root, tmp_path):
    t = translate_argv(root, mlc_args(RUN_MINDFORMER, "python run_mindformer.py", "train"))
    assert t.argv == ["train", "--config=configs/glm5/glm5_7b_lora.yaml", "device=npu",
                      'data.train="/workspace/data/qa_processed.bin"', 'model="/workspace/models/glm5-7b.ckpt"',
                      'output_dir="/workspace/output/lora_finetune"']
    assert "--device_target Ascend -> device=npu" in t.notes and len(t.notes) == 7
    path = tmp_path / "lora.yaml"
    path.write_text(GLM5_7B_LORA_YAML.replace("model_parallel: 2", "model_parallel: 1"), encoding="utf-8")
    cfg = load_train_config(path, t.argv[2:])
    assert (cfg.device, cfg.data.train, cfg.output_dir) == ("npu", "/workspace/data/qa_processed.bin",
                                                             "/workspace/output/lora_finetune")
    with pytest.raises(ModelFormatError, match="MindSpore/MindFormers checkpoint"):
        resolve_model_dir(cfg.model)


@pytest.mark.parametrize("mode,equivalent", [("eval", "mlc-cli eval "), ("predict", "mlc-cli generate")])
def test_other_run_modes_name_our_command(root, mode, equivalent):
    with pytest.raises(ConfigError, match=equivalent):
        translate_argv(root, ["train", f"--run_mode={mode}"])

