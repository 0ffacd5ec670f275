"""transformers as the numerical reference: tiny random models, checkpoint round trips and the parity checks every
architecture runs (dense prompts of several lengths, a batch of different lengths, paged decode vs dense)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlc.models.base import CausalLM
from mlc.models.loader import load_model
from tests.support.paged import incremental_logits

TOL = 1e-4  # max abs logit difference allowed in fp32
# glm and glm4 (GLM-4 and GLM-4-0414) tiny configs: q/k/v biases, half rotary
GLM_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=256,
                pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5})
PROMPT_LENGTHS = (1, 7, 33)
BATCH_LENGTHS = (7, 33, 12, 1)


@dataclass
class Pair:
    """A transformers model and ours, loaded from the checkpoint the former saved."""

    hf: torch.nn.Module
    ours: CausalLM
    path: Path


def randomize_(model: torch.nn.Module, std: float = 0.5, seed: int = 0) -> None:
    """Every saved parameter and buffer ~ N(0, std): HF init zeros biases and e_score_correction_bias and sets norms
    to 1, which would leave those paths untested. Non-persistent buffers (rotary inv_freq) are derived, not saved."""
    saved = set(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name in saved and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std)


def reference_model(model_cls, config, seed: int = 0, std: float = 0.5) -> torch.nn.Module:
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # MoE: the per-expert loop, not grouped_mm
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, std=std, seed=seed)
    return model


def load_pair(model_cls, config, path: Path, seed: int = 0) -> Pair:
    hf = reference_model(model_cls, config, seed)
    hf.save_pretrained(path)
    return Pair(hf, load_model(path), path)


def prompt(length: int, vocab: int = 256, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def batch_prompts(vocab: int = 256) -> list[list[int]]:
    return [prompt(n, vocab, seed=i + 1) for i, n in enumerate(BATCH_LENGTHS)]


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    return hf(input_ids=ids, position_ids=torch.arange(len(tokens))[None], use_cache=False).logits[0].float()


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str, tol: float = TOL) -> float:
    assert [g.shape for g in got] == [w.shape for w in want], f"{what}: shapes differ"
    diff = max(float((g - w).abs().max()) for g, w in zip(got, want))
    print(f"[parity] {what}: max abs diff {diff:.2e}")
    assert diff < tol, f"{what}: max abs diff {diff:.3e} exceeds {tol:.0e}"
    return diff


def check_dense(pair: Pair, seqs: list[list[int]]) -> float:
    """Our dense forward of all `seqs` in one flat batch vs transformers run on each alone."""
    got = pair.ours.dense_logits(seqs)
    want = [hf_logits(pair.hf, s) for s in seqs]
    return assert_close(got, want, f"{type(pair.ours).__name__} dense, lengths {[len(s) for s in seqs]}")


def check_incremental(pair: Pair, seqs: list[list[int]], chunk: int) -> float:
    """Prefill 3 tokens, then `chunk` (or 1) tokens a step through the paged cache == our dense forward."""
    dense = pair.ours.dense_logits(seqs)
    steps = incremental_logits(pair.ours, seqs, prefill=3, chunk=chunk)
    return assert_close(steps, dense, f"{type(pair.ours).__name__} paged, chunk {chunk}")


class ParitySuite:
    """Shared parity tests; subclass as `TestX` next to a `pair` fixture (module or class scope)."""

    @pytest.mark.parametrize("length", PROMPT_LENGTHS)
    def test_prompt_matches_transformers(self, pair: Pair, length: int):
        check_dense(pair, [prompt(length, pair.hf.config.vocab_size)])

    def test_batch_of_different_lengths_matches_transformers(self, pair: Pair):
        check_dense(pair, batch_prompts(pair.hf.config.vocab_size))

    @pytest.mark.parametrize("chunk", (1, 5))
    def test_paged_decode_equals_dense(self, pair: Pair, chunk: int):
        check_incremental(pair, batch_prompts(pair.hf.config.vocab_size), chunk)


# MoE checkpoint layouts
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def to_fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> transformers' in-memory 3-D `experts.gate_up_proj`
    (gate rows first) and `experts.down_proj`."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if m := _PER_EXPERT.match(name):
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
        else:
            out[name] = t
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((by_expert[e]["gate_proj"], by_expert[e]["up_proj"]))
                                                     for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def to_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub layout: one `gate_proj`, `up_proj` and `down_proj` weight per expert."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        for e, w in enumerate(t):
            if m[2] == "down_proj":
                out[f"{m[1]}.{e}.down_proj.weight"] = w.clone()
            else:
                gate, up = w.chunk(2)
                out[f"{m[1]}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{m[1]}.{e}.up_proj.weight"] = up.clone()
    return out


def mtp_layer_tensors(tensors: dict[str, torch.Tensor], source_layer: int, mtp_layer: int) -> dict[str, torch.Tensor]:
    """A DeepSeek-style MTP layer as the GLM hub checkpoints ship it: a copy of a decoder layer's tensors (random
    values) plus eh_proj, enorm, hnorm and shared_head, under `model.layers.{mtp_layer}`."""
    gen = torch.Generator().manual_seed(mtp_layer)
    src = f"model.layers.{source_layer}."
    out = {f"model.layers.{mtp_layer}." + n[len(src):]: torch.randn(t.shape, generator=gen)
           for n, t in tensors.items() if n.startswith(src)}
    hidden = tensors["model.norm.weight"].shape[0]
    vocab = tensors["lm_head.weight"].shape[0]
    extra = {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
             "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (vocab, hidden)}
    out.update({f"model.layers.{mtp_layer}.{n}": torch.randn(s, generator=gen) for n, s in extra.items()})
    return out


def write_checkpoint(src_dir: Path, dst_dir: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """Copy `src_dir`'s config files and write `tensors` as `shards` safetensors files (with an index if > 1)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(src_dir).iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copy(f, dst_dir / f.name)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(dst_dir / "model.safetensors"))
        return dst_dir
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(dst_dir / file))
        weight_map.update(dict.fromkeys(part, file))
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst_dir
