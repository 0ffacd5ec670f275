"""The preference stages on the LoRA recipe: dpo (pref_loss sigmoid/ipo/orpo/simpo), kto and rm.

Same loop, checkpoints, resume, overflow guard and adapter output as SFT (`LoRATrainer`); what changes is the data
(pairs or labelled replies, `mlc.train.pref_data`), the loss (`mlc.train.pref_losses`) and the logged metrics
(rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies; kl for kto).

The reference model of dpo (sigmoid, ipo) and kto is the policy itself with its adapter disabled, under no_grad: one
copy of the weights. orpo and simpo need no reference. rm trains a scalar head (`score`, hidden -> 1) on the last
token's final hidden state with the adapter; the head is saved inside the adapter (PEFT modules_to_save), so the
adapter dir is the whole reward model (`mlc.train.reward.load_reward_model`).
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F

from mlc.train import pref_losses as L
from mlc.train.data import StepPlan, model_inputs
from mlc.train.logging import ConsoleReporter
from mlc.train.model import attach_lora, autocast
from mlc.train.pref_data import kto_batches, load_pref_rows, pair_batch
from mlc.train.preprocess import IGNORE_INDEX, pad_token_id
from mlc.train.reward import HEAD, add_reward_head, last_token_scores
from mlc.train.trainer import LoRATrainer


class PreferenceTrainer(LoRATrainer):
    def _load_data(self) -> None:
        cfg = self.cfg
        kind = "kto" if cfg.stage == "kto" else "pair"
        self.pad_id = pad_token_id(self.tokenizer)
        args = (self.tokenizer, kind, cfg.max_seq_len, cfg.data.pad_to_multiple_of, self.pad_id, cfg.data.format)
        self.rows, stats = load_pref_rows(cfg.data.train, *args)
        self.eval_rows = load_pref_rows(cfg.data.eval, *args)[0] if cfg.data.eval else []
        self.plan = StepPlan(len(self.rows), cfg.batch_size, cfg.gradient_accumulation_steps, cfg.seed)
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else max(
            1, round((cfg.epochs or 1.0) * self.plan.steps_per_epoch))
        stats_file = self.out / "data_stats.json"
        stats_file.write_text(json.dumps({"stage": cfg.stage, "source": stats.source, "rows": stats.rows,
                                          "dropped": stats.dropped}, indent=2), encoding="utf-8")
        if stats.dropped:
            self.reporter_note = (f"{len(stats.dropped)} training row(s) dropped (first: line "
                                  f"{stats.dropped[0]['line']}: {stats.dropped[0]['reason']}); see {stats_file}")

    def _attach(self, base):
        if self.cfg.stage != "rm":
            return attach_lora(base, self.cfg.lora)
        add_reward_head(base)
        return attach_lora(base, self.cfg.lora, modules_to_save=[HEAD])

    # losses
    def _logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed reply log-probs, reply token counts, logits) per row, with the adapter."""
        with autocast(self.device, self.dtype):
            logits = self.model(**model_inputs(batch, self.device)).logits
        logps, counts = L.sequence_logps(logits, batch["labels"].to(self.device))
        return logps, counts, logits

    @torch.no_grad()
    def _ref_logps(self, batch: dict) -> torch.Tensor:
        with self.peft_model.disable_adapter():
            with autocast(self.device, self.dtype):
                logits = self.peft_model(**model_inputs(batch, self.device)).logits
        return L.sequence_logps(logits, batch["labels"].to(self.device))[0]

    def _chosen_nll(self, logits: torch.Tensor, labels: torch.Tensor, n: int) -> torch.Tensor:
        """Mean token cross-entropy of the first n rows (the chosen replies)."""
        targets = labels[:n, 1:].to(self.device)
        return F.cross_entropy(logits[:n, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)

    def batch_loss(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, int]:
        """(loss, chosen rewards, rejected rewards, extra metrics, tokens) of one micro-batch."""
        cfg, n = self.cfg, len(rows)
        if cfg.stage == "kto":
            batch, kl_batch = kto_batches(rows, self.pad_id, cfg.data.pad_to_multiple_of)
            policy, _, _ = self._logps(batch)
            with torch.no_grad():
                kl_policy = self._logps(kl_batch)[0]
            ref, kl_ref = self._ref_logps(batch), self._ref_logps(kl_batch)
            desirable = torch.tensor([r["label"] for r in rows], device=policy.device)
            loss, chosen, rejected, kl = L.kto(policy, ref, desirable, kl_policy, kl_ref, cfg.pref_beta,
                                               cfg.kto_chosen_weight, cfg.kto_rejected_weight)
            return loss, chosen, rejected, {"kl": float(kl)}, int(batch["attention_mask"].sum())
        batch = pair_batch(rows, self.pad_id)
        tokens = int(batch["attention_mask"].sum())
        if cfg.stage == "rm":
            with autocast(self.device, self.dtype):
                scores = last_token_scores(self.peft_model, batch, self.device)
            loss, chosen, rejected = L.bradley_terry(scores[:n], scores[n:])
            return loss, chosen, rejected, {}, tokens
        logps, counts, logits = self._logps(batch)
        pc, pr, nc, nr = logps[:n], logps[n:], counts[:n], counts[n:]
        nll = self._chosen_nll(logits, batch["labels"], n)
        if cfg.pref_loss == "orpo":
            loss, chosen, rejected = L.orpo(pc / nc, pr / nr, nll, cfg.pref_beta)
            return loss, chosen, rejected, {"nll": float(nll.detach())}, tokens
        if cfg.pref_loss == "simpo":
            loss, chosen, rejected = L.simpo(pc / nc, pr / nr, cfg.pref_beta, cfg.simpo_gamma)
        else:
            ref = self._ref_logps(batch)
            rc, rr = ref[:n], ref[n:]
            loss, chosen, rejected = (L.ipo(pc, pr, rc, rr, nc, nr, cfg.pref_beta) if cfg.pref_loss == "ipo"
                                      else L.dpo_sigmoid(pc, pr, rc, rr, cfg.pref_beta))
        if cfg.pref_ftx:
            loss = loss + cfg.pref_ftx * nll
        return loss, chosen, rejected, {}, tokens

    # one step
    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        micro = [[self.rows[i] for i in idx] for idx in self.plan.micro_batches(step)]
        total_rows = sum(len(m) for m in micro)
        mean_loss, tokens = 0.0, 0
        chosen, rejected, extras = [], [], []
        for i, rows in enumerate(micro):
            loss, c, r, extra, n_tokens = self.batch_loss(rows)
            if i == 0 and step + 1 in self.opts.inject_nonfinite_steps:
                loss = loss * float("inf")
            share = len(rows) / total_rows
            (loss * share).backward()
            mean_loss += float(loss.detach()) * share
            tokens += n_tokens
            chosen.append(c)
            rejected.append(r)
            extras.append(extra)
        grad_norm, lr, finite = self._update(mean_loss)
        elapsed = time.perf_counter() - t0
        record = {
            "step": step + 1, "epoch": round((step + 1) / self.plan.steps_per_epoch, 4), "loss": mean_loss,
            "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "skipped": not finite, "seconds": elapsed,
        }
        record.update(self._metrics(chosen, rejected, extras))
        return record

    def _metrics(self, chosen: list, rejected: list, extras: list[dict]) -> dict:
        out = L.reward_metrics(torch.cat(chosen), torch.cat(rejected))
        if self.cfg.stage == "kto" and "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        for key in extras[0] if extras else ():
            out[key] = sum(e[key] for e in extras) / len(extras)
        return out

    # evaluation
    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.eval_rows:
            return None
        self.peft_model.eval()
        size = max(self.cfg.batch_size, 2)
        chunks = [self.eval_rows[i : i + size] for i in range(0, len(self.eval_rows), size)]
        chunks = [c for c in chunks if len(c) > 1 or self.cfg.stage != "kto"]  # kto's KL needs two rows
        losses, chosen, rejected, extras = [], [], [], []
        for rows in chunks:
            loss, c, r, extra, _ = self.batch_loss(rows)
            losses.append((float(loss), len(rows)))
            chosen.append(c)
            rejected.append(r)
            extras.append(extra)
        self.peft_model.train()
        self._eval_metrics = {f"eval_{k}": v for k, v in self._metrics(chosen, rejected, extras).items()}
        return sum(v * n for v, n in losses) / max(sum(n for _, n in losses), 1)

    def _log_eval(self, step: int, loss: float | None, reporter: ConsoleReporter) -> None:
        if loss is None:
            return
        record = {"step": step, "eval_loss": loss, **getattr(self, "_eval_metrics", {})}
        self.log.append(record)
        acc = record.get("eval_rewards/accuracies")
        shown = f", reward accuracy {acc:.2f}" if acc is not None and math.isfinite(acc) else ""
        reporter.note(f"step {step}: eval {self.cfg.stage} loss {loss:.4f}{shown}")
