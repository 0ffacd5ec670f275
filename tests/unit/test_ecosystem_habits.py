"""What people bring from vLLM, LLaMA-Factory and Hugging Face: the offline API's names, vLLM's serve flags, the
positional model and config, LLaMA-Factory's training keys, and models from the local HF cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from mlc.cli.compat import translate_argv
from mlc.cli.main import _register_all, app, main
from mlc.config.loader import detect_kind, load_train_config, read_yaml
from mlc.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from tests.support.tiny_llama import build_tiny_llama

LLAMA_FACTORY_YAML = """\
### model
model_name_or_path: THUDM/glm-4-9b-chat
### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_target: q_proj,v_proj
### dataset
dataset: qa
dataset_dir: data
template: glm4
cutoff_len: 1024
### output
output_dir: saves/glm4/lora/sft
logging_steps: 10
save_steps: 500
save_total_limit: 3
### train
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
max_grad_norm: 1.0
bf16: true
"""


@pytest.fixture(scope="module")
def root():
    _register_all()
    return typer.main.get_command(app)


def test_sampling_params_max_tokens_is_vllms_name():
    from mlc import SamplingParams

    params = SamplingParams(max_tokens=5, temperature=0.0)
    assert params.max_new_tokens == params.max_tokens == 5
    params.max_tokens = 7
    assert params.max_new_tokens == 7
    assert SamplingParams(max_new_tokens=5, max_tokens=5).max_tokens == 5
    with pytest.raises(InvalidRequestError, match="disagree") as e:
        SamplingParams(max_new_tokens=5, max_tokens=6)
    assert e.value.field == "max_tokens"


def test_vllm_serve_flags(root):
    line = ("serve THUDM/glm-4-9b-chat --max-model-len 4096 --max-num-seqs 16 --gpu-memory-utilization 0.85 "
            "--enable-prefix-caching --block-size 16 --lora-modules support=runs/a "
            '{"name":"qa","path":"runs/b"} --served-model-name glm4 --tensor_parallel_size 2')
    t = translate_argv(root, line.split())
    assert t.notes == [
        "--gpu-memory-utilization 0.85 -> --kv-cache-fraction 0.85 (the share of the memory free after the weights "
        "load that the KV cache takes)",
        '--lora-modules support=runs/a {"name":"qa","path":"runs/b"} -> --lora support=runs/a --lora qa=runs/b',
        "--tensor_parallel_size 2 -> --tensor-parallel-size 2",
    ]
    params = root.commands["serve"].make_context("serve", t.argv[1:]).params
    assert params["model_arg"] == "THUDM/glm-4-9b-chat" and params["max_seq_len"] == 4096
    assert params["max_batch_size"] == 16 and params["kv_cache_fraction"] == 0.85 and params["enable_prefix_caching"]
    assert params["page_size"] == 16 and params["lora"] == ["support=runs/a", "qa=runs/b"]
    assert params["served_model_name"] == "glm4" and params["tensor_parallel_size"] == 2


def test_one_spelling_per_idea_with_the_old_ones_kept(root):
    for command in ("serve", "generate", "chat"):
        params = root.commands[command].make_context(command, ["--seq-len", "256", "--kv-dtype", "int8"]).params
        assert (params["max_seq_len"], params["kv_cache_dtype"]) == (256, "int8")
    params = root.commands["generate"].make_context("generate", ["--batch", "3", "--max-batch-size", "4"]).params
    assert params["max_batch_size"] == 4  # the same option: the last one given wins


def test_generic_underscore_and_boolean_spellings(root):
    t = translate_argv(root, ["serve", "--strict_input=true", "--prefix-caching=false", "--api_key", "k"])
    assert t.argv == ["serve", "--strict-input", "--no-prefix-caching", "--api-key", "k"]
    assert len(t.notes) == 3
    untouched = ["generate", "--prompt", "--max_seq_len=5", "--", "--device_id"]
    assert translate_argv(root, untouched).argv == untouched  # an option's value and anything after -- are data


def test_serve_model_positional_or_flag():
    from mlc.cli.serve import pick_model

    assert pick_model("a", None) == pick_model(None, "a") == pick_model("a", "a") == "a"
    with pytest.raises(ConfigError, match="given twice"):
        pick_model("a", "b")


def test_train_config_positional(tmp_path, capsys):
    from mlc.cli.train import split_config_arg

    assert split_config_arg(["lora.yaml", "max_steps=2"], None) == (["max_steps=2"], Path("lora.yaml"))
    assert split_config_arg(["max_steps=2"], None) == (["max_steps=2"], None)
    with pytest.raises(ConfigError, match="two configs"):
        split_config_arg(["a.yaml"], Path("b.yaml"))
    path = tmp_path / "lf.yaml"  # the whole command line, stopped by validation before any training
    path.write_text("model_name_or_path: x\nparallel_config: {pipeline_stage: 4}\n")
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    assert e.value.code == 2 and "parallel_config.pipeline_stage: 4" in capsys.readouterr().err


def test_llama_factory_training_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/dataset_info.json").write_text('{"qa": {"file_name": "qa.jsonl"}}')
    (tmp_path / "lf.yaml").write_text(LLAMA_FACTORY_YAML)
    assert detect_kind(read_yaml(tmp_path / "lf.yaml")) == "lora"
    notes: list[str] = []
    cfg = load_train_config(tmp_path / "lf.yaml", None, notes)
    assert cfg.model == "THUDM/glm-4-9b-chat" and cfg.data.train == "data/qa.jsonl"
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (16, 32, ["q_proj", "v_proj"])
    assert (cfg.max_seq_len, cfg.batch_size, cfg.gradient_accumulation_steps, cfg.epochs) == (1024, 2, 4, 3.0)
    assert (cfg.optimizer.lr, cfg.lr_schedule.type, cfg.lr_schedule.warmup_ratio) == (1e-4, "cosine", 0.1)
    assert (cfg.save_every, cfg.keep_checkpoints, cfg.log_every, cfg.clip_norm) == (500, 3, 10, 1.0)
    assert cfg.precision == "bf16" and cfg.output_dir == "saves/glm4/lora/sft"
    label = str(tmp_path / "lf.yaml")
    assert f"{label}: cutoff_len -> max_seq_len" in notes and f"{label}: dataset -> data.train" in notes
    assert any("template: glm4 -> the chat template in the model's tokenizer_config.json" in n for n in notes)


@pytest.mark.parametrize("extra,message", [
    ("stage: ppo\n", "ppo and pt are not built"), ("finetuning_type: full\n", "LoRA adapters"),
    ("lora_target: all\nbf16: true\nfp16: true\n", "keep one"), ("dataset: a,b\n", "one file"),
    ("dataset: nowhere\n", "neither a file nor an entry"),
])
def test_llama_factory_values_we_cannot_follow_are_refused(tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lf.yaml").write_text("model_name_or_path: x\n" + extra)
    with pytest.raises(ConfigError, match=message):
        load_train_config(tmp_path / "lf.yaml")


def fake_hf_cache(home: Path, repo: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/files}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs/main").write_text(commit)
    return snapshot


def test_hf_repo_id_resolves_through_the_local_cache(tmp_path, monkeypatch):
    from mlc.models.loader import load_model
    from mlc.models.store import resolve_model_dir, resolve_tokenizer_dir

    model_dir = build_tiny_llama(tmp_path / "tiny")
    snapshot = fake_hf_cache(tmp_path / "hf", "tiny-org/tiny-llama", model_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_model_dir("tiny-org/tiny-llama") == snapshot
    assert resolve_tokenizer_dir("tiny-org/tiny-llama") == snapshot
    assert load_model("tiny-org/tiny-llama").model_dir == snapshot
    with pytest.raises(ModelNotFoundError, match=r"not a local path, not in the store .*, not in the Hugging Face "
                                                 r"cache .*; run `mlc-cli models pull tiny-org/absent` first, or pass "
                                                 r"--pull"):
        resolve_model_dir("tiny-org/absent")


def test_every_optional_module_names_its_extra():
    import tomllib

    from mlc.cli.extras import EXTRA_OF, missing_extra_message

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert extra in extras, (module, extra)
        message = missing_extra_message(ModuleNotFoundError(name=f"{module}.sub"))
        assert message and f"install `mlc[{extra}]`" in message
    for module in ("llguidance", "jsonschema", "lm_eval", "ray"):
        assert module in EXTRA_OF
    assert missing_extra_message(ModuleNotFoundError(name="mlc.engine")) is None
