"""`doctor`: a healthy and a broken model store, Ascend device nodes, invisible prompt characters, a bad train log."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from mlc.doctor import host as doctor_host
from mlc.doctor.run import (
    DoctorOptions,
    blocking,
    check_ascend,
    check_config,
    check_hf_offline,
    check_memory,
    check_port,
    check_prompt_file,
    check_store,
    check_train_log,
    invisible_characters,
    run_doctor,
)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_model(home, name="tiny"):
    from mlc.models import store

    root = home / "models" / name
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "model.safetensors").write_bytes(os.urandom(4096))
    manifest = {"name": name, "revision": "test", "files": store.file_records(root)}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_healthy_store_passes(home):
    fake_model(home, "a")
    fake_model(home, "b")
    checks = check_store()
    assert [c.status for c in checks] == ["ok", "ok"]
    assert "sha256 verified" in checks[0].detail and checks[0].name == "store: a"


def test_broken_store_fails_and_names_the_file(home):
    root = fake_model(home)
    data = bytearray((root / "model.safetensors").read_bytes())
    data[100] ^= 0xFF
    (root / "model.safetensors").write_bytes(bytes(data))
    (c,) = check_store()
    assert c.status == "fail" and "model.safetensors" in c.detail and "pull tiny --force" in c.fix
    (root / "config.json").unlink()
    (c,) = check_store(["tiny"])
    assert c.status == "fail" and "config.json is missing" in c.detail


def test_empty_store_warns(home):
    (c,) = check_store()
    assert c.status == "warn" and "models pull" in c.fix


def test_invisible_characters_with_positions(tmp_path):
    text = "总结以下条款\u200b：\nplain line\n\ufeffstarts with a BOM and a soft\u00adhyphen\ttab ok\n"
    assert [(ln, col, hex(ord(ch))) for ln, col, ch in invisible_characters(text)] == [
        (1, 7, "0x200b"), (3, 1, "0xfeff"), (3, 30, "0xad")]
    path = tmp_path / "prompt.txt"
    path.write_text(text, encoding="utf-8")
    c = check_prompt_file(path)
    assert c.status == "fail" and "U+200B" in c.detail
    assert c.items[0] == "line 1 col 7: U+200B ZERO WIDTH SPACE"
    assert c.items[1] == "line 3 col 1: U+FEFF ZERO WIDTH NO-BREAK SPACE"


def test_clean_prompt_and_unreadable_prompt(tmp_path):
    clean = tmp_path / "clean.txt"
    clean.write_text("请用中文总结以下法律条款：《民法典》第1024条\n\ttabs and newlines are fine\n", encoding="utf-8")
    assert check_prompt_file(clean).status == "ok"
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert check_prompt_file(binary).status == "fail"
    assert check_prompt_file(tmp_path / "missing.txt").status == "fail"


def test_train_log_with_non_finite_losses(tmp_path):
    lines = [
        {"step": 1, "loss": 2.1, "grad_norm": 0.9},
        {"step": 2, "loss": "nan", "grad_norm": "inf", "skipped": True},  # how train_log.jsonl writes them
        {"step": 3, "eval_loss": "-inf"},
    ]
    path = tmp_path / "train_log.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 4, "loss": NaN}\n{"step": 5,')
    c = check_train_log(tmp_path)  # a run dir works too
    assert c.status == "fail" and "4 non-finite" in c.detail
    assert c.items[:2] == ["line 2 (step 2): loss = nan", "line 2 (step 2): grad_norm = inf"]
    assert "line 4 (step 4): loss = nan" in c.items
    assert "lr" in c.fix and "clip_norm" in c.fix


def test_finite_train_log_passes(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 3.0 - i / 10, "grad_norm": 1.0}) + "\n" for i in range(5)))
    c = check_train_log(path)
    assert c.status == "ok" and "5 records" in c.detail
    assert check_train_log(tmp_path / "nope.jsonl").status == "fail"


def test_ascend_device_nodes(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    assert check_ascend(dev).status == "skip"
    for name in ("davinci0", "davinci1", "davinci_manager", "devmm_svm"):
        (dev / name).touch()
        os.chmod(dev / name, 0o660)
    c = check_ascend(dev)
    assert c.status == "fail" and any("hisi_hdc: missing" in i for i in c.items)
    (dev / "hisi_hdc").touch()
    os.chmod(dev / "hisi_hdc", 0o660)
    os.chmod(dev / "davinci1", 0o600)
    c = check_ascend(dev)
    if os.geteuid() == 0:  # root may open anything: the owner-only mode is still reported
        assert c.status == "warn" and any("davinci1: -rw-------" in i and "owner only" in i for i in c.items)
    else:
        assert c.status == "fail"
    assert "chmod 660" in c.fix and "usermod" in c.fix
    os.chmod(dev / "davinci1", 0o660)
    c = check_ascend(dev)
    assert c.status in ("ok", "warn") and "2 NPU node(s)" in c.detail  # warn only when torch_npu is absent
    assert stat.filemode((dev / "davinci0").stat().st_mode) in c.items[0]


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert check_port(port, required=True).status == "fail"
        assert check_port(port, required=False).status == "warn"
    assert check_port(port, required=True).status == "ok"


def test_config_check(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {kv_cache_dtype: fp8}\n")
    c = check_config(bad)
    assert c.status == "fail" and "engine.kv_cache_dtype" in c.detail and "allowed" in c.detail
    lint_error = tmp_path / "310p.yaml"
    lint_error.write_text("engine: {device: npu, dtype: bf16}\n")
    c = check_config(lint_error, "ascend-310p")
    assert c.status == "fail" and any("dtype-unsupported" in i for i in c.items)
    ok = tmp_path / "ok.yaml"
    ok.write_text("engine: {page_size: 16}\n")
    assert check_config(ok, "cpu").status == "ok"


def test_memory_and_offline_checks():
    assert check_memory({"MemAvailable": 512 * 2**20, "MemTotal": 2**31}).status == "fail"
    assert check_memory({"MemAvailable": 2 * 2**30, "MemTotal": 2**33}).status == "warn"
    assert check_memory({"MemAvailable": 16 * 2**30, "MemTotal": 2**35}).status == "ok"
    assert check_hf_offline({"HF_HUB_OFFLINE": "1"}).status == "ok"
    assert check_hf_offline({}).status == "warn"


def test_run_doctor_blocks_on_failures(home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_model(home)
    checks = run_doctor(DoctorOptions(port=None))
    names = [c.name for c in checks]
    assert names[:3] == ["python", "packages", "cpu"] and "store: tiny" in names
    assert not blocking(checks), [c for c in checks if c.status == "fail"]
    prompt = tmp_path / "p.txt"
    prompt.write_text("a\u200bb")
    assert blocking(run_doctor(DoctorOptions(prompt_file=prompt, verify_store=False)))


def test_doctor_cli_exit_codes(home, tmp_path, capsys, monkeypatch):
    from mlc.cli.main import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_model(home)
    with pytest.raises(SystemExit) as e:
        main(["doctor"])
    assert (e.value.code or 0) == 0 and "nothing blocks" in capsys.readouterr().out
    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 1, "loss": "nan"}\n')
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--train-log", str(log), "--json", "--no-store"])
    assert e.value.code == 1
    checks = json.loads(capsys.readouterr().out)
    assert any(c["name"] == "train log" and c["status"] == "fail" for c in checks)


def test_versions_parse():
    assert doctor_host._version_tuple("2.13.0+cpu") == (2, 13)
    assert doctor_host._version_tuple("5.23.0.dev0") == (5, 23)
