"""Preference stages on a tiny random GLM-4: our losses against TRL 1.x's definitions, computed here a second way
(one unpadded row at a time, the formulas as TRL writes them), over 5 training steps; the margin rising on the
example set; the reward model loaded back; bad input refused before a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mlc.config.loader import validate_train_config
from mlc.errors import DataError
from mlc.train.logging import TrainLog
from mlc.train.pref_data import load_pref_rows
from mlc.train.pref_trainer import PreferenceTrainer
from mlc.train.preprocess import IGNORE_INDEX
from mlc.train.run import RunOptions, train
from tests.support.tiny_glm import build_tiny_glm

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is the weather in Paris?", "Let me check the forecast", "get the city name", "the tags are math"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    build_tiny_glm(root / "glm", moe=False)
    pairs = [{"instruction": f"{q} {i}", "chosen": f"Paris is sunny, {i} days. What is the weather?",
              "rejected": f"no {i}"} for i in range(4) for q in QUESTIONS]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    kto = [{"instruction": p["instruction"], "output": p["chosen"] if i % 2 else p["rejected"], "label": bool(i % 2)}
           for i, p in enumerate(pairs)]
    (root / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kto))
    return root


def config(work: Path, stage: str, out: str, **over):
    raw = {"model": str(work / "glm"), "stage": stage,
           "data": {"train": str(work / ("kto.jsonl" if stage == "kto" else "pairs.jsonl")), "eval": None},
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
           "optimizer": {"lr": 5e-3}, "batch_size": 4, "max_steps": 5, "max_seq_len": 128, "precision": "fp32",
           "seed": 3, "output_dir": str(work / out), **over}
    return validate_train_config(raw)


def row_logp(model, row: dict, reference: bool = False) -> tuple[torch.Tensor, int]:
    """Summed log-prob of one row's reply, unpadded, through the plain transformers forward."""
    n = sum(row["attention_mask"])
    ids = torch.tensor([row["input_ids"][:n]])
    labels = torch.tensor(row["labels"][:n])
    ctx = model.disable_adapter() if reference else torch.enable_grad()
    with ctx:
        logits = model(input_ids=ids).logits[0, :-1]
    mask = labels[1:] != IGNORE_INDEX
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels[1:].clamp(min=0)[:, None])[:, 0]
    return (logp * mask).sum(), int(mask.sum())


def trl_reference(trainer, rows: list[dict]) -> torch.Tensor:
    """The loss as TRL 1.16 defines it (dpo_trainer, cpo_trainer, orpo_trainer, kto_trainer, reward_trainer)."""
    cfg, m, beta = trainer.cfg, trainer.peft_model, trainer.cfg.pref_beta
    if cfg.stage == "kto":
        pol = torch.stack([row_logp(m, r)[0] for r in rows])
        with torch.no_grad():
            ref = torch.stack([row_logp(m, r, True)[0] for r in rows])
            # KL pairs: row i's prompt with row i-1's reply (TRL's add_kl_completion_ids)
            kl_rows = []
            for i, r in enumerate(rows):
                o = rows[i - 1]
                p, q = r["prompt_len"], o["prompt_len"]
                ids = r["input_ids"][:p] + o["input_ids"][q : o["length"]]
                kl_rows.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                                "labels": [IGNORE_INDEX] * p + o["labels"][q : o["length"]]})
            kl = torch.stack([row_logp(m, r)[0] - row_logp(m, r, True)[0] for r in kl_rows]).mean().clamp(min=0)
        lab = torch.tensor([r["label"] for r in rows])
        ratios = pol - ref
        chosen_losses = 1 - F.sigmoid(beta * (ratios[lab] - kl))
        rejected_losses = 1 - F.sigmoid(beta * (kl - ratios[~lab]))
        return torch.cat((cfg.kto_chosen_weight * chosen_losses, cfg.kto_rejected_weight * rejected_losses)).nanmean()
    pc, nc = zip(*(row_logp(m, r["chosen"]) for r in rows))
    pr, nr = zip(*(row_logp(m, r["rejected"]) for r in rows))
    pc, pr, nc, nr = torch.stack(pc), torch.stack(pr), torch.tensor(nc), torch.tensor(nr)
    if cfg.pref_loss in ("sigmoid", "ipo"):
        with torch.no_grad():
            rc = torch.stack([row_logp(m, r["chosen"], True)[0] for r in rows])
            rr = torch.stack([row_logp(m, r["rejected"], True)[0] for r in rows])
        if cfg.pref_loss == "sigmoid":
            return (-F.logsigmoid(beta * ((pc - rc) - (pr - rr)))).mean()
        delta = (pc - rc) / nc - (pr - rr) / nr
        return ((delta - 1 / (2 * beta)) ** 2).mean()
    avg_c, avg_r = pc / nc, pr / nr
    if cfg.pref_loss == "simpo":  # CPOTrainer with loss_type simpo, cpo_alpha 0
        logits = (avg_c - avg_r) - cfg.simpo_gamma / beta
        return (-F.logsigmoid(beta * logits)).mean()

    def log1mexp(x):
        return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))

    nll = -pc.sum() / nc.sum()  # ORPOTrainer: token-mean cross entropy of the chosen replies
    log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
    return nll - (beta * F.logsigmoid(log_odds)).mean()


@pytest.mark.parametrize("stage,pref_loss", [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "orpo"),
                                             ("dpo", "simpo"), ("kto", "sigmoid")])
def test_losses_match_trl_over_five_steps(work, stage, pref_loss):
    trainer = PreferenceTrainer(config(work, stage, f"trl-{stage}-{pref_loss}", pref_loss=pref_loss),
                                RunOptions(fresh=True, progress=False))
    trainer.setup()
    seen = []
    for step in range(5):
        rows = [trainer.rows[i] for i in trainer.plan.micro_batches(step)[0]]
        with torch.no_grad():
            expected = float(trl_reference(trainer, rows))
        record = trainer.train_step(step)  # our batched loss, then the update
        assert record["loss"] == pytest.approx(expected, abs=1e-4), (step, record["loss"], expected)
        seen.append(record["loss"])
    assert len(set(seen)) == 5  # the weights moved between the compared steps


def test_reward_margin_rises_on_the_example_set(work):
    cfg = config(work, "dpo", "margin", data={"train": str(REPO / "data/pref_support.jsonl"),
                                              "eval": str(REPO / "data/pref_support.jsonl")},
                 max_seq_len=512, max_steps=8, batch_size=2, optimizer={"lr": 2e-2})
    result = train(cfg, RunOptions(fresh=True, progress=False))
    evals = TrainLog(result.output_dir).eval_records()
    assert evals[0]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert evals[-1]["eval_rewards/margins"] > 0.05 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    steps = TrainLog(result.output_dir).step_records()
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(steps[-1])
    import matplotlib.image

    from mlc.train.plot import plot_loss

    picture = matplotlib.image.imread(plot_loss(result.output_dir))
    assert picture.shape[0] == 800  # the loss panel and the rewards panel below it (an SFT plot is 450 high)


@pytest.mark.parametrize("stage", ["dpo", "rm"])
def test_a_resumed_preference_run_continues_the_same_curve(work, stage):
    import shutil

    from mlc.errors import ConfigError

    cfg = config(work, stage, f"resume-{stage}", max_steps=4, save_every=2, batch_size=2, optimizer={"lr": 2e-2})
    first = train(cfg, RunOptions(fresh=True, progress=False))
    whole = {r["step"]: r["loss"] for r in TrainLog(first.output_dir).step_records()}
    shutil.rmtree(Path(first.output_dir) / "checkpoints" / "step-000004")
    again = train(cfg, RunOptions(progress=False))
    assert again.resumed_from == 2
    resumed = {r["step"]: r["loss"] for r in TrainLog(again.output_dir).step_records()}
    assert resumed == pytest.approx(whole, abs=1e-6) and len(resumed) == 4
    other = config(work, "rm" if stage == "dpo" else "dpo", f"resume-{stage}", max_steps=4, save_every=2,
                   batch_size=2)
    with pytest.raises(ConfigError, match="different .*stage"):
        train(other, RunOptions(progress=False))


def test_reward_model_is_saved_loaded_back_and_scores(work):
    from mlc.train.export import export_adapter
    from mlc.train.pref_data import pair_batch
    from mlc.train.reward import last_token_scores, load_reward_model

    result = train(config(work, "rm", "rm", max_steps=3, optimizer={"lr": 2e-2}),
                   RunOptions(fresh=True, progress=False))
    steps = TrainLog(result.output_dir).step_records()
    assert "rewards/accuracies" in steps[-1]
    exported = export_adapter(result.adapter_dir, work / "rm-export", overwrite=True)
    rm = load_reward_model(exported)
    scores = rm.score("What is the weather in Paris? 0", ["Paris is sunny, 0 days. What is the weather?", "no 0"])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    # the same numbers as the trained model gives its training rows
    rows, _ = load_pref_rows(work / "pairs.jsonl", rm.tokenizer, "pair", 128, 16, rm.tokenizer.pad_token_id)
    batch = pair_batch(rows[:1], rm.tokenizer.pad_token_id)
    again = last_token_scores(rm.model, batch, torch.device("cpu"))
    assert again.tolist() == pytest.approx(rm.score(
        [{"role": "user", "content": "What is the weather in Paris? 0"}],
        ["Paris is sunny, 0 days. What is the weather?", "no 0"]), abs=1e-5)
    assert scores[0] != scores[1]
    with pytest.raises(Exception, match="reward model"):
        export_adapter(result.adapter_dir, work / "rm-merged", merge=True)


@pytest.mark.parametrize("row,says", [
    ({"instruction": "q", "chosen": "a"}, "line 2: no 'rejected' reply"),
    ({"instruction": "q", "chosen": "same", "rejected": " same "}, "line 2: chosen and rejected are the same"),
    ({"instruction": "q", "chosen": "a", "rejected": ""}, "line 2: 'rejected' is missing or empty"),
])
def test_bad_pairs_are_refused_with_their_line(work, tmp_path, row, says):
    from mlc.models.tokenizer import load_tokenizer

    tok = load_tokenizer(work / "glm")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"instruction": "q", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=says):
        load_pref_rows(path, tok, "pair", 128, 16, tok.pad_token_id)


def test_kto_rows_need_a_label_before_any_step(work, tmp_path):
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps({"instruction": "q", "output": "a", "label": True}) + "\n"
                    + json.dumps({"instruction": "q", "output": "b"}) + "\n")
    with pytest.raises(DataError, match="k.jsonl line 2: no 'label' label"):
        train(config(work, "kto", "kto-bad", data={"train": str(path), "eval": None}),
              RunOptions(fresh=True, progress=False))
    assert not (work / "kto-bad" / "train_log.jsonl").exists()


@pytest.mark.parametrize("over,says", [
    ({"stage": "kto", "batch_size": 1}, "batch_size: 2 or more"),
    ({"nproc": 2}, "one process"),
    ({"data": {"train": "x.jsonl", "packing": True}}, "packing: false"),
    ({"data": {}}, "needs pairwise data; set data.train"),
])
def test_setups_a_stage_cannot_run_are_refused(over, says):
    from mlc.errors import ConfigError

    raw = {"stage": "dpo", "data": {"train": "data/pref_support.jsonl"}, **over}
    with pytest.raises(ConfigError, match=says):
        validate_train_config(raw)


def test_llama_factory_keys_and_dataset_entry(tmp_path, monkeypatch):
    from mlc.config.loader import load_train_config

    monkeypatch.chdir(REPO)
    path = tmp_path / "lf.yaml"
    path.write_text("stage: DPO\npref_loss: simpo\npref_beta: 2.0\nsimpo_gamma: 1.0\nfinetuning_type: lora\n"
                    "dataset_dir: data\ndataset: pref_support\n")
    cfg = load_train_config(path)
    cfg = cfg[0] if isinstance(cfg, tuple) else cfg
    assert (cfg.stage, cfg.pref_loss, cfg.pref_beta, cfg.simpo_gamma) == ("dpo", "simpo", 2.0, 1.0)
    assert cfg.data.train.endswith("pref_support.jsonl") and cfg.data.eval is None


def test_example_sets_load_as_registered_and_sft_refuses_them(work):
    from mlc.models.tokenizer import load_tokenizer
    from mlc.train.preprocess import PreprocessOptions, tokenize_file

    tok = load_tokenizer(work / "glm")
    pairs, _ = load_pref_rows(REPO / "data/pref_support.jsonl", tok, "pair", 1024, 16, tok.pad_token_id)
    held_out, _ = load_pref_rows(REPO / "data/pref_support_eval.jsonl", tok, "pair", 1024, 16, tok.pad_token_id)
    kto, _ = load_pref_rows(REPO / "data/kto_support.jsonl", tok, "kto", 1024, 16, tok.pad_token_id)
    assert (len(pairs), len(held_out), len(kto)) == (24, 6, 60)
    assert sum(r["label"] for r in kto) == 30
    with pytest.raises(DataError, match="entry 'pref_support' describes preference data .* set stage: dpo or rm"):
        tokenize_file(REPO / "data/pref_support.jsonl", tok, PreprocessOptions())
    with pytest.raises(DataError, match="entry 'kto_support' describes KTO data.*set stage: kto"):
        tokenize_file(REPO / "data/kto_support.jsonl", tok, PreprocessOptions())
    with pytest.raises(DataError, match="describes KTO rows.*use stage: kto"):
        load_pref_rows(REPO / "data/kto_support.jsonl", tok, "pair", 1024, 16, tok.pad_token_id)
