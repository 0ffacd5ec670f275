"""Held-out loss and perplexity of a model (optionally with a LoRA adapter), masked exactly like training."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mlc.config.device import resolve_device
from mlc.models.store import resolve_model_dir
from mlc.models.tokenizer import load_tokenizer, render_chat
from mlc.train.data import collate, load_rows, target_count
from mlc.train.formats import RecordError, to_messages
from mlc.train.model import compute_dtype, load_adapter, load_base_model, loss_sum
from mlc.train.preprocess import PreprocessOptions, data_schema, pad_token_id, read_records


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    rows: int
    target_tokens: int
    dropped: int
    samples: list[dict]


def load_scoring_model(model: str | Path, adapter: str | Path | None, device: str = "cpu", precision: str = "auto"):
    model_dir = resolve_model_dir(model)
    dev = resolve_device(device)
    dtype = compute_dtype(precision, dev)
    net = load_base_model(model_dir, dtype, dev)
    if adapter is not None:
        net = load_adapter(net, adapter)
    net.eval()
    return net, load_tokenizer(model_dir), dev, dtype


@torch.no_grad()
def score_rows(net, rows: list[dict], tokenizer, device, dtype, batch_size: int = 8,
               progress=None) -> tuple[float, int]:
    """(summed token loss, target tokens) over `rows`; `progress(rows done, rows)` after each batch."""
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], pad_token_id(tokenizer))
        total += float(loss_sum(net, batch, device, dtype))
        count += target_count(batch)
        if progress:
            progress(min(i + batch_size, len(rows)), len(rows))
    return total, count


@torch.no_grad()
def greedy_answers(
    net, tokenizer, data: str | Path, n: int, max_new_tokens: int = 160, fmt: str = "auto",
) -> list[dict]:
    """The model's greedy answers to the first `n` prompts of `data` (transformers' generate)."""
    samples: list[dict] = []
    fmt, schema = data_schema(data, fmt)  # a dataset_info.json entry's columns/tags, as the loss reads them
    for record in read_records(data):
        if len(samples) >= n:
            break
        try:
            _, messages = to_messages(record, fmt, schema)
        except RecordError:
            continue  # the loss already counts it as dropped
        prompt = render_chat(tokenizer, messages[:-1], add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(net.device)
        out = net.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            use_cache=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_token_id(tokenizer),
        )
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        samples.append({"prompt": messages[-2]["content"], "answer": answer, "reference": messages[-1]["content"]})
    return samples


def evaluate(
    model: str | Path, data: str | Path, adapter: str | Path | None = None, *, max_seq_len: int = 512,
    batch_size: int = 8, fmt: str = "auto", device: str = "cpu", precision: str = "auto", samples: int = 0,
    max_new_tokens: int = 160, progress=None,
) -> EvalResult:
    """`progress(rows scored, rows)` is called after each batch."""
    net, tokenizer, dev, dtype = load_scoring_model(model, adapter, device, precision)
    opts = PreprocessOptions(max_seq_len=max_seq_len, format=fmt)
    rows, stats = load_rows(data, tokenizer, opts)
    total, count = score_rows(net, rows, tokenizer, dev, dtype, batch_size, progress)
    loss = total / max(count, 1)
    shown = (greedy_answers(net, tokenizer, data, samples, max_new_tokens, fmt)
             if samples and Path(data).is_file() else [])
    return EvalResult(
        loss=loss, perplexity=math.exp(min(loss, 50.0)), rows=len(rows), target_tokens=count,
        dropped=len(stats.get("dropped", [])), samples=shown,
    )
