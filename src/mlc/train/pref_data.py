"""Rows of the preference stages: pairwise (dpo, rm) and labelled (kto), tokenized with the SFT chat template.

Pairwise rows are LLaMA-Factory's ranking rows: the prompt as in SFT data (alpaca `instruction`/`input`/`system`,
or sharegpt/chat turns ending with the user's) plus `chosen` and `rejected` replies (strings, or one turn each as
`{"from": "gpt", "value": ...}` / `{"role": "assistant", "content": ...}`). KTO rows are SFT rows with one reply
and a label (`label` by default, `columns.kto_tag` in dataset_info.json): true for a desirable reply.

Each reply is tokenized as prompt + reply exactly as SFT would (labels -100 on the prompt). Bad rows are refused
with their line before the model loads: a missing or empty chosen/rejected, identical chosen and rejected, a KTO
row without a true/false label; a pair longer than max_seq_len is dropped and counted like an SFT row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mlc.config.dataset_info import DatasetSchema
from mlc.errors import DataError
from mlc.train.data import collate
from mlc.train.formats import RecordError, to_messages
from mlc.train.preprocess import IGNORE_INDEX, data_schema, pad_row, read_records, tokenize_messages


@dataclass
class PrefStats:
    source: str
    rows: int = 0
    dropped: list[dict] = field(default_factory=list)


def _reply_text(value, where: str, key: str, schema: DatasetSchema) -> str:
    if isinstance(value, dict):  # one sharegpt/chat turn
        value = value.get(schema.tag("content_tag"), value.get("content"))
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        return _reply_text(value[0], where, key, schema)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {key!r} is missing or empty; every pairwise row needs a chosen and a rejected "
                        "reply (fix or remove the row)")
    return value


def _prompt_messages(record: dict, fmt: str, schema: DatasetSchema, where: str) -> list[dict]:
    """The conversation up to the reply: the record's turns with a placeholder reply, which is then removed."""
    probe = dict(record)
    turns_key = schema.col("messages")
    if isinstance(record.get("messages"), list) or isinstance(record.get(turns_key), list):
        key = "messages" if isinstance(record.get("messages"), list) else turns_key
        turns = list(record[key])
        last_role = turns[-1].get("role", turns[-1].get(schema.tag("role_tag"))) if turns and isinstance(
            turns[-1], dict) else None
        if last_role in ("assistant", schema.tag("assistant_tag")):
            turns = turns[:-1]  # an SFT-style row with its reply: the pair replaces it
        reply = {"role": "assistant", "content": "x"} if key == "messages" else {
            schema.tag("role_tag"): schema.tag("assistant_tag"), schema.tag("content_tag"): "x"}
        probe[key] = [*turns, reply]
    else:
        probe[schema.col("response") or "output"] = "x"
    try:
        _, messages = to_messages(probe, fmt, schema)
    except RecordError as e:
        raise DataError(f"{where}: {e}") from None
    return messages[:-1]


def _tokenize(tokenizer, prompt: list[dict], reply: str, train_on_prompt: bool) -> tuple[list[int], list[int]]:
    return tokenize_messages(tokenizer, [*prompt, {"role": "assistant", "content": reply}], train_on_prompt)


def _label(value, where: str, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise DataError(f"{where}: KTO rows need {key!r}: true (a desirable reply) or false (an undesirable one), got "
                    f"{value!r}; label the row or remove it")


def load_pref_rows(path: str | Path, tokenizer, kind: str, max_seq_len: int, multiple: int, pad_id: int,
                   fmt: str = "auto", train_on_prompt: bool = False) -> tuple[list[dict], PrefStats]:
    """`kind` "pair": rows {"chosen": row, "rejected": row}; "kto": rows {"input_ids", "labels", "attention_mask",
    "label", "prompt_len"}. Each row is padded to `multiple` like SFT rows."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found")
    _, schema = data_schema(path, fmt)
    if kind == "pair" and schema.kto:
        raise DataError(f"{path}: {schema.source} describes KTO rows (columns.kto_tag); use stage: kto")
    if kind == "kto" and schema.ranking:
        raise DataError(f"{path}: {schema.source} describes pairwise rows (ranking: true); use stage: dpo or rm")
    cols = schema.preference
    stats = PrefStats(source=str(path))
    rows: list[dict] = []
    for line_no, record in enumerate(read_records(path), start=1):
        where = f"{path} line {line_no}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: a row must be a JSON object, got {type(record).__name__}")
        prompt = _prompt_messages(record, fmt, schema, where)
        if kind == "pair":
            for key in (cols["chosen"], cols["rejected"]):
                if key not in record:
                    raise DataError(f"{where}: no {key!r} reply (keys: {', '.join(record)}); a pairwise row needs "
                                    f"{cols['chosen']!r} and {cols['rejected']!r}")
            chosen = _reply_text(record[cols["chosen"]], where, cols["chosen"], schema)
            rejected = _reply_text(record[cols["rejected"]], where, cols["rejected"], schema)
            if chosen.strip() == rejected.strip():
                raise DataError(f"{where}: chosen and rejected are the same reply; a pair must differ (fix or "
                                "remove the row)")
            pair = [_tokenize(tokenizer, prompt, reply, train_on_prompt) for reply in (chosen, rejected)]
            if max(len(ids) for ids, _ in pair) > max_seq_len:
                stats.dropped.append({"line": line_no, "reason": f"longer than max_seq_len {max_seq_len}"})
                continue
            rows.append({name: pad_row(ids, labels, multiple, pad_id)
                         for name, (ids, labels) in zip(("chosen", "rejected"), pair)})
        else:
            key = cols["kto_tag"]
            if key not in record:
                raise DataError(f"{where}: no {key!r} label; KTO rows need {key!r}: true or false")
            label = _label(record[key], where, key)
            reply = record.get(schema.col("response") or "output")
            if isinstance(record.get("messages"), list) or isinstance(record.get(schema.col("messages")), list):
                _, messages = to_messages(record, fmt, schema)
                reply = messages[-1]["content"]
            ids, labels = _tokenize(tokenizer, prompt, _reply_text(reply, where, "reply", schema), False)
            if len(ids) > max_seq_len:
                stats.dropped.append({"line": line_no, "reason": f"longer than max_seq_len {max_seq_len}"})
                continue
            prompt_len = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
            if train_on_prompt:
                labels = [IGNORE_INDEX, *ids[1:]]
            rows.append({**pad_row(ids, labels, multiple, pad_id), "label": label, "prompt_len": prompt_len,
                         "length": len(ids)})
    stats.rows = len(rows)
    if kind == "kto" and rows and len({r["label"] for r in rows}) == 1:
        only = "desirable" if rows[0]["label"] else "undesirable"
        raise DataError(f"{path}: every KTO row is {only}; KTO needs both desirable and undesirable replies")
    return rows, stats


def pair_batch(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """One batch of 2B rows: the B chosen replies, then the B rejected ones (TRL's layout)."""
    return collate([r["chosen"] for r in rows] + [r["rejected"] for r in rows], pad_id)


def kto_batches(rows: list[dict], pad_id: int, multiple: int) -> tuple[dict, dict]:
    """The batch and its KL batch: row i's prompt with row i-1's reply (TRL cycles replies by one in a batch)."""
    kl_rows = []
    for i, row in enumerate(rows):
        other = rows[i - 1]
        p, q = row["prompt_len"], other["prompt_len"]
        ids = row["input_ids"][:p] + other["input_ids"][q : other["length"]]
        labels = [IGNORE_INDEX] * p + other["labels"][q : other["length"]]
        kl_rows.append(pad_row(ids, labels, multiple, pad_id))
    return collate(rows, pad_id), collate(kl_rows, pad_id)
