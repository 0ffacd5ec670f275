"""The training loss (`train/model.loss_sum`): the output head run only where a label is, a few target tokens at a
time with each chunk's logits recomputed in the backward, gives the loss and the adapter's gradients of the plain
full-logits cross entropy, with padded and with packed rows (issue 32's chunked cross entropy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlc.config.train_config import LoraSection
from mlc.train import model as train_model
from mlc.train.data import collate, model_inputs
from mlc.train.model import attach_lora, load_base_model, loss_sum
from mlc.train.preprocess import IGNORE_INDEX, pack_rows
from tests.support.tiny_llama import build_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory):
    torch.manual_seed(0)
    model = attach_lora(load_base_model(build_tiny_llama(tmp_path_factory.mktemp("m") / "llama")),
                        LoraSection(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapter's gradients all non-trivial
            torch.nn.init.normal_(p, std=0.1)
    return model


def rows(packing: bool) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    examples = []
    for n, prompt in ((9, 4), (13, 7), (6, 2), (11, 5)):
        ids = torch.randint(3, 250, (n,), generator=g).tolist()
        examples.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))  # the prompt carries no loss
    if packing:
        return pack_rows(examples, max_seq_len=24, multiple=8, pad_id=0)
    return [{"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)} for ids, labels in examples]


def plain(model, batch) -> torch.Tensor:
    logits = model(**model_inputs(batch, CPU)).logits
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_loss_and_gradients_equal_the_full_logits_ones(peft_model, monkeypatch, packing):
    monkeypatch.setattr(train_model, "CE_CHUNK_TOKENS", 5)  # several chunks, the last one short
    batch = collate(rows(packing), pad_id=0)
    assert ("position_ids" in batch) == packing
    assert train_model._decoder_and_head(peft_model) is not None  # the chunked path is the one taken
    want = plain(peft_model, batch)
    want_grads = grads(peft_model, want)
    got = loss_sum(peft_model, batch, CPU, torch.float32)
    got_grads = grads(peft_model, got)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 12
    for name, g in want_grads.items():
        assert g.abs().max() > 0, name
        assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_packed_rows_keep_each_rows_loss(peft_model, train_on_prompt):
    """Rows packed into one sequence attend only within themselves, and a row's first token is no target: the packed
    loss is the sum of the rows' losses alone."""
    g = torch.Generator().manual_seed(2)
    examples = []
    for n, prompt in ((9, 4), (13, 7), (6, 2)):
        ids = torch.randint(3, 250, (n,), generator=g).tolist()
        examples.append((ids, ids if train_on_prompt else [IGNORE_INDEX] * prompt + ids[prompt:]))
    (packed,) = pack_rows(examples, max_seq_len=32, multiple=8, pad_id=0)
    with torch.no_grad():
        alone = sum(float(loss_sum(peft_model, collate([{"input_ids": ids, "labels": labels,
                                                          "attention_mask": [1] * len(ids)}], 0), CPU, torch.float32))
                    for ids, labels in examples)
        together = loss_sum(peft_model, collate([packed], 0), CPU, torch.float32)
    assert float(together) == pytest.approx(alone, rel=1e-5)


def test_a_batch_without_targets_gives_zero_and_a_graph(peft_model):
    batch = collate(rows(False), pad_id=0)
    batch["labels"][:] = IGNORE_INDEX
    loss = loss_sum(peft_model, batch, CPU, torch.float32)
    assert float(loss.detach()) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads(peft_model, loss).values())


def test_a_model_type_that_may_scale_its_logits_takes_the_plain_path(peft_model, monkeypatch):
    monkeypatch.setattr(peft_model.get_base_model().config, "model_type", "granite")  # logits / logits_scaling
    assert train_model._decoder_and_head(peft_model) is None
