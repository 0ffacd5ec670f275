"""Real training runs on a tiny random Llama: overflow guard, kill -9 + resume, 2 processes, eval, export/merge."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mlc.config.loader import validate_train_config
from mlc.errors import ConfigError, TrainingError
from mlc.train.checkpoint import MANIFEST_FILE, checkpoint_problem, list_checkpoints
from mlc.train.logging import TrainLog
from mlc.train.run import RunOptions, train
from tests.support.tiny_llama import build_tiny_llama

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
QUESTIONS = ["Where is my order", "How do I get a refund", "Can I change my address", "我的订单在哪里",
             "How long does shipping take", "Is there a warranty", "如何退货", "Can I cancel my order"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    build_tiny_llama(root / "model")
    rows = [{"instruction": f"{q} #{i}?", "output": f"Hello, thank you for contacting us. Answer {i} to {q}. Bye!"}
            for i in range(6) for q in QUESTIONS]
    (root / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[:40]))
    (root / "eval.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[40:]))
    return root


def config(work: Path, out: str, **over) -> dict:
    raw = {
        "model": str(work / "model"),
        "data": {"train": str(work / "train.jsonl"), "eval": str(work / "eval.jsonl")},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["query", "value"]},
        "optimizer": {"lr": 1e-2}, "lr_schedule": {"warmup_steps": 2},
        "batch_size": 4, "max_steps": 8, "max_seq_len": 64, "save_every": 4, "seed": 7,
        "precision": "fp32",  # the equality checks below are fp32 tolerances, whatever this CPU supports
        "output_dir": str(work / out),
    }
    for key, value in over.items():
        node = raw
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return raw


def run_inproc(work: Path, out: str, opts: RunOptions | None = None, **over):
    return train(validate_train_config(config(work, out, **over)), opts or RunOptions(fresh=True, progress=False))


def cli(work: Path, out: str, *extra: str, **over) -> subprocess.Popen:
    path = work / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config(work, out, **over)))
    cmd = [sys.executable, "-m", "mlc.cli.main", "train", "--config", str(path), "--quiet", *extra]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: float(r["loss"]) for r in TrainLog(run_dir).step_records()}


def adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_overflow_guard_skips_an_injected_inf_step(work):
    result = run_inproc(
        work, "guard", RunOptions(fresh=True, progress=False, inject_nonfinite_steps=frozenset({3})), save_every=1,
        keep_checkpoints=10, **{"lora.dropout": 0.0},
    )
    records = {r["step"]: r for r in TrainLog(work / "guard").step_records()}
    assert records[3]["skipped"] is True and records[3]["loss"] == "inf" and records[3]["skipped_total"] == 1
    assert all(not records[s]["skipped"] for s in (1, 2, 4, 5, 6, 7, 8))
    assert all(torch.isfinite(torch.tensor(float(records[s]["loss"]))) for s in (4, 8))
    assert result.skipped_steps == 1 and result.steps == 8
    ckpts = {p.name: p for p in list_checkpoints(work / "guard")}
    before, after = adapter_tensors(ckpts["step-000002"]), adapter_tensors(ckpts["step-000003"])
    assert all(torch.equal(before[k], after[k]) for k in before)  # the optimizer did not step
    moved = adapter_tensors(ckpts["step-000004"])
    assert any(not torch.equal(after[k], moved[k]) for k in after)
    opt2 = torch.load(ckpts["step-000002"] / "optimizer.pt", weights_only=True)
    opt3 = torch.load(ckpts["step-000003"] / "optimizer.pt", weights_only=True)
    assert all(torch.equal(opt2["state"][i]["exp_avg"], opt3["state"][i]["exp_avg"]) for i in opt2["state"])


def test_too_many_bad_steps_in_a_row_stop_with_advice(work):
    opts = RunOptions(fresh=True, progress=False, inject_nonfinite_steps=frozenset({2, 3, 4}))
    with pytest.raises(TrainingError, match=r"3 steps in a row \(up to step 4\).*lower optimizer\.lr.*--resume"):
        run_inproc(work, "diverge", opts, max_consecutive_bad_steps=3)
    skipped = [r["step"] for r in TrainLog(work / "diverge").step_records() if r["skipped"]]
    assert skipped == [2, 3, 4]


def test_kill9_then_resume_matches_an_uninterrupted_run(work):
    over = {"max_steps": 100, "save_every": 10, "batch_size": 8, "gradient_accumulation_steps": 2}
    victim = cli(work, "victim", **over)
    log = work / "victim" / "train_log.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and victim.poll() is None:
        steps = [json.loads(line)["step"] for line in log.read_text().splitlines()] if log.exists() else []
        if steps and steps[-1] >= 11:
            break
        time.sleep(0.005)
    assert victim.poll() is None, "the run finished before it could be killed; make it longer"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (work / "victim" / "adapter").exists()
    killed_at = max(losses(work / "victim"))
    resumed_from = int(list_checkpoints(work / "victim")[-1].name.split("-")[1])
    assert resumed_from >= 10 and killed_at < 100
    resumed = cli(work, "victim", **over)  # no flag: resumes because output_dir has a checkpoint
    run_inproc(work, "ref", **over)  # the uninterrupted run, meanwhile
    assert f"step {resumed_from}" in finish(resumed)
    ref, got = losses(work / "ref"), losses(work / "victim")
    assert sorted(got) == sorted(ref) == list(range(1, 101))
    worst = max(abs(ref[s] - got[s]) for s in ref)
    assert worst <= 1e-5, f"resumed curve differs from the uninterrupted one by {worst}"
    a, b = adapter_tensors(work / "ref" / "adapter"), adapter_tensors(work / "victim" / "adapter")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_two_processes_match_one_with_twice_the_accumulation(work):
    over = {"lora.dropout": 0.0, "max_steps": 6, "batch_size": 2}
    two = cli(work, "ddp2", "--nproc", "2", gradient_accumulation_steps=2, **over)
    run_inproc(work, "ddp1", gradient_accumulation_steps=4, **over)
    finish(two)
    a, b = losses(work / "ddp1"), losses(work / "ddp2")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5
    eval1 = [r["eval_loss"] for r in TrainLog(work / "ddp1").eval_records()]
    eval2 = [r["eval_loss"] for r in TrainLog(work / "ddp2").eval_records()]
    assert len(eval1) == len(eval2) == 2 and max(abs(x - y) for x, y in zip(eval1, eval2)) < 1e-5
    w1, w2 = adapter_tensors(work / "ddp1" / "adapter"), adapter_tensors(work / "ddp2" / "adapter")
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)


@pytest.fixture(scope="module")
def trained(work):
    result = run_inproc(work, "trained", max_steps=12)
    return Path(result.adapter_dir), result


def test_training_lowers_eval_loss_and_writes_artifacts(work, trained):
    _, result = trained
    run = work / "trained"
    assert result.eval_loss_after < result.eval_loss_before
    assert (run / "loss.png").stat().st_size > 0 and (run / "summary.json").is_file()
    assert json.loads((run / "data_stats.json").read_text())["rows"] == 40
    first = TrainLog(run).step_records()[0]
    assert set(first) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "skipped", "skipped_total"}
    assert [p.name for p in list_checkpoints(run)] == ["step-000008", "step-000012"]  # keep_checkpoints = 2
    (run / "loss.png").unlink()
    proc = subprocess.run([sys.executable, "-m", "mlc.cli.main", "train", "plot", str(run)], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (run / "loss.png").stat().st_size > 0


def test_eval_matches_the_trainers_masked_loss(work, trained):
    from mlc.train.evaluate import evaluate

    adapter, result = trained
    with_adapter = evaluate(work / "model", work / "eval.jsonl", adapter, max_seq_len=64, precision="fp32")
    base = evaluate(work / "model", work / "eval.jsonl", max_seq_len=64, precision="fp32")
    assert abs(with_adapter.loss - result.eval_loss_after) < 1e-5
    assert abs(base.loss - result.eval_loss_before) < 1e-5
    assert with_adapter.rows == 8 and with_adapter.perplexity == pytest.approx(
        torch.exp(torch.tensor(with_adapter.loss)).item())


def test_export_merge_equals_base_plus_adapter(work, trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlc.models.loader import load_model
    from mlc.train.export import export_adapter

    adapter, _ = trained
    lora_b = [t for k, t in adapter_tensors(adapter).items() if "lora_B" in k]
    assert lora_b and max(float(t.abs().max()) for t in lora_b) > 1e-3  # training moved B off its zero init
    merged_dir = export_adapter(adapter, tmp_path / "merged", merge=True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in merged_dir.iterdir()}
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 2, 50, 51, 52]])
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(work / "model")),
                                                str(adapter)).eval()(ids).logits[0]
        merged_logits = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()(ids).logits[0]
        base_logits = AutoModelForCausalLM.from_pretrained(str(work / "model")).eval()(ids).logits[0]
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the merge changed the model
    ours = load_model(merged_dir).dense_logits([ids[0].tolist()])[0]
    torch.testing.assert_close(ours, merged_logits, atol=1e-4, rtol=1e-4)
    only = export_adapter(adapter, tmp_path / "adapter_only")
    assert sorted(p.name for p in only.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(ConfigError, match="already exists"):
        export_adapter(adapter, tmp_path / "adapter_only")


def test_resume_refuses_a_changed_config(work, trained):
    cfg = validate_train_config(config(work, "trained", max_steps=12, seed=8))
    with pytest.raises(ConfigError, match="different seed.*--fresh"):
        train(cfg, RunOptions(progress=False))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        train(validate_train_config(config(work, "empty_run")), RunOptions(resume="always", progress=False))


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    from mlc.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().err


def test_cli_errors_are_one_line_without_traceback(work, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "Q", "output": "A"}\n{broken\n')
    argv = ["preprocess", str(bad), "--out", str(tmp_path / "o"), "--model", str(work / "model"), "--on-error", "fail"]
    code, err = run_main(argv, capsys)
    assert code == 2 and f"{bad}:2: invalid JSON" in err and "Traceback" not in err
    path = tmp_path / "c.yaml"
    path.write_text("lora:\n  rank: 8\n")
    code, err = run_main(["train", "-c", str(path)], capsys)
    assert code == 2 and "lora.rank: unknown key" in err and "Traceback" not in err
    code, err = run_main(["train", "--resume", "--fresh"], capsys)
    assert code == 2 and "contradict" in err


# damaged checkpoints at resume
@pytest.fixture(scope="module")
def saved(work):
    """A finished 4-step run with checkpoints at steps 2 and 4; its losses are what a resume from step 2 must redo."""
    run_inproc(work, "saved", max_steps=4, save_every=2)
    return work / "saved"


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "half":
        path.write_bytes(data[: len(data) // 2])
    else:  # "flip": same size, one byte in the middle changed
        path.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :])


@pytest.mark.parametrize("manifest,name,how,reason", [
    (True, "adapter_model.safetensors", "empty", r"adapter_model\.safetensors has size 0, expected \d+"),
    (True, "optimizer.pt", "flip", r"optimizer\.pt has a different sha256"),
    (False, "adapter_model.safetensors", "half", r"adapter_model\.safetensors is truncated or corrupt"),
    (False, "adapter_model.safetensors", "empty", r"adapter_model\.safetensors is truncated or corrupt"),
    (False, "rng-rank0.pt", "empty", r"rng-rank0\.pt is truncated or corrupt"),
])
def test_resume_skips_a_damaged_newest_checkpoint(work, saved, capsys, manifest, name, how, reason):
    out = f"damaged-{name}-{how}-{manifest}"
    shutil.copytree(saved, work / out)
    newest, older = list_checkpoints(work / out)[::-1]
    if not manifest:  # checkpoints saved before manifests existed are checked by loading every file
        for ckpt in (newest, older):
            (ckpt / MANIFEST_FILE).unlink()
    damage(newest / name, how)
    capsys.readouterr()
    result = run_inproc(work, out, RunOptions(progress=False), max_steps=4, save_every=2)
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and "Traceback" not in err, err
    assert re.search(rf"checkpoint \S*step-000004 skipped: {reason}.*; resuming from step-000002 instead", skipped[0])
    assert result.resumed_from == 2
    ref, got = losses(saved), losses(work / out)
    assert sorted(got) == [1, 2, 3, 4] and max(abs(ref[s] - got[s]) for s in ref) <= 1e-6
    assert [p.name for p in list_checkpoints(work / out)] == ["step-000002", "step-000004"]
    assert checkpoint_problem(list_checkpoints(work / out)[-1]) is None  # the redone step 4 replaced the damaged one


def test_no_usable_checkpoint_starts_over_loudly_or_fails_with_resume(work, saved, capsys):
    shutil.copytree(saved, work / "all_damaged")
    for ckpt in list_checkpoints(work / "all_damaged"):
        damage(ckpt / "adapter_model.safetensors", "empty")
    with pytest.raises(TrainingError, match=r"--resume: none of the 2 checkpoint\(s\) .* is usable.*--fresh"):
        train(validate_train_config(config(work, "all_damaged", max_steps=4, save_every=2)),
              RunOptions(resume="always", progress=False))
    capsys.readouterr()
    result = run_inproc(work, "all_damaged", RunOptions(progress=False), max_steps=4, save_every=2)
    err = capsys.readouterr().err
    assert err.count("skipped: adapter_model.safetensors has size 0") == 2
    assert "no usable checkpoint" in err and "STARTING OVER FROM STEP 0" in err
    assert result.resumed_from is None and sorted(losses(work / "all_damaged")) == [1, 2, 3, 4]
    assert all(checkpoint_problem(p) is None for p in list_checkpoints(work / "all_damaged"))

