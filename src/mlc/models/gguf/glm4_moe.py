"""GLM-4.5 / 4.6 / 4.7 GGUFs (llama.cpp architecture `glm4moe`): config keys and tensor names that differ from llama's.

What llama.cpp's converter writes for Glm4MoeForCausalLM:
- `block_count` counts the multi-token-prediction (NextN) layers too (`nextn_predict_layers` of them, last): a whole
  decoder layer plus `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` (and copies of the
  embedding and head, `nextn.embed_tokens` / `nextn.shared_head_head`, never read). The forward skips them, as
  transformers does; speculative method "mtp" loads them as the checkpoint's MTP layer (`nextn_tensor_name`).
- Layers below `leading_dense_block_count` have a dense SwiGLU MLP (`ffn_gate`, `ffn_up`, `ffn_down`); the others
  have the router (`ffn_gate_inp`), its correction bias (`exp_probs_b.bias`), the routed experts stacked over
  the expert axis (`ffn_{gate,up,down}_exps`, `[E, I, H]` / `[E, H, I]`) and the shared expert (`ffn_*_shexp`).
- The norm before the MLP is `post_attention_norm` (not llama's `ffn_norm`), and per-head q/k norms are
  `attn_q_norm` / `attn_k_norm`.
- q/k rows are stored as HF has them: GLM-4.5 rotates half-split (NeoX) pairs, which is llama.cpp's NEOX rope, so
  nothing is permuted (llama permutes; glm4 does not either)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from mlc.errors import ModelFormatError
from mlc.models.gguf.dequant import dequantize_tensor
from mlc.models.gguf.reader import GGUFFile

# glm4moe.* metadata keys read by `glm4_moe_config` (on top of llama's)
GLM4_MOE_KEYS = {
    "expert_count", "expert_used_count", "expert_shared_count", "expert_feed_forward_length",
    "leading_dense_block_count", "expert_weights_scale", "expert_weights_norm", "expert_gating_func",
    "expert_group_count", "expert_group_used_count", "nextn_predict_layers",
}
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1 is softmax)

ATTENTION_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
}
DENSE_NAMES = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate.weight",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # stored as `.bias`; HF's name has no suffix
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_experts.down_proj.weight",
}
# the routed experts, stacked per projection: gate and up -> mlp.experts.gate_up_proj [E, 2I, H] (gate rows first),
# down -> mlp.experts.down_proj [E, H, I] (3-D parameters, no `.weight` suffix)
_STACK = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
PROJECTIONS = ("gate", "up", "down")
Stacks = dict[int, dict[str, Any]]  # layer -> projection -> its stacked GGUF tensor
TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)$")


def _int(gf: GGUFFile, key: str, default: int | None = None) -> int:
    value = gf.arch_key(key, default)
    if value is None:
        raise ModelFormatError(
            f"{gf.path.name}: metadata key glm4moe.{key} is missing; the GGUF is incomplete (re-convert it with a "
            "current llama.cpp convert_hf_to_gguf.py)"
        )
    return int(value)


def _first_moe_layer(names: set[str], n_layers: int) -> int:
    return next((i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in names), n_layers)


def glm4_moe_config(gf: GGUFFile, cfg: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The llama-shaped config (read from the same keys under `glm4moe.`) turned into HF's Glm4MoeConfig."""
    cfg = {**cfg, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}
    cfg.pop("mlp_bias", None)
    nextn = _int(gf, "nextn_predict_layers", 0)
    n_layers = cfg["num_hidden_layers"] - nextn
    if n_layers < 1:
        raise ModelFormatError(f"{gf.path.name}: block_count {cfg['num_hidden_layers']} leaves no decoder layer "
                               f"beside its {nextn} NextN layer(s); the GGUF is damaged")
    gating = gf.arch_key("expert_gating_func", SIGMOID_GATING)
    if int(gating) != SIGMOID_GATING:
        raise ModelFormatError(f"{gf.path.name}: expert_gating_func {gating} is not the sigmoid router (2) that "
                               "GLM-4.5 uses; mlc runs glm4moe GGUFs with sigmoid gating only")
    dense = _int(gf, "leading_dense_block_count", _first_moe_layer(names, n_layers))
    if _first_moe_layer(names, n_layers) != dense:
        raise ModelFormatError(f"{gf.path.name}: leading_dense_block_count is {dense} but the first layer with "
                               f"experts is {_first_moe_layer(names, n_layers)}; the GGUF is inconsistent")
    moe_i = _int(gf, "expert_feed_forward_length")
    shared = gf.arch_key("expert_shared_count")
    if shared is None:  # older files: count the shared experts from the tensor's rows
        shexp = next((t for t in gf.reader.tensors if t.name == f"blk.{dense}.ffn_gate_shexp.weight"), None)
        shared = 0 if shexp is None else int(shexp.shape[1]) // moe_i
    cfg.update(
        num_hidden_layers=n_layers, num_nextn_predict_layers=nextn,  # loaded for speculative method "mtp" only
        moe_intermediate_size=moe_i, n_routed_experts=_int(gf, "expert_count"),
        num_experts_per_tok=_int(gf, "expert_used_count"), n_shared_experts=int(shared),
        first_k_dense_replace=dense, routed_scaling_factor=float(gf.arch_key("expert_weights_scale", 1.0)),
        # llama.cpp reads a missing expert_weights_norm as false, so a file without it runs unnormalized there too
        norm_topk_prob=bool(gf.arch_key("expert_weights_norm", False)),
        n_group=_int(gf, "expert_group_count", 1), topk_group=_int(gf, "expert_group_used_count", 1),
        use_qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    # Glm4MoeConfig takes 0.5 when partial_rotary_factor is absent; the GGUF's rope.dimension_count decides here
    cfg["rope_parameters"] = {"partial_rotary_factor": 1.0, **cfg["rope_parameters"]}
    return cfg


# a NextN layer's own tensors -> the hub checkpoint's names after `model.layers.{N}.`
NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm"}
NEXTN_COPIES = re.compile(r"blk\.\d+\.nextn\.(embed_tokens|shared_head_head)\.weight$")  # the trunk's, never read


def nextn_tensor_name(gguf_name: str, first_moe_layer: int) -> str | None:
    """A tensor of the NextN layer -> its HF name (`blk.46.nextn.eh_proj.weight` -> `model.layers.46.eh_proj.weight`;
    its decoder layer's tensors as any layer's); None for a name with no place there."""
    m = re.match(r"blk\.(\d+)\.nextn\.(\w+)\.weight$", gguf_name)
    if m is None or m[2] not in NEXTN_NAMES:
        return glm4_moe_tensor_name(gguf_name, first_moe_layer)
    return f"model.layers.{m[1]}.{NEXTN_NAMES[m[2]]}.weight"


def stacked_projection(name: str) -> tuple[int, str] | None:
    """`blk.3.ffn_up_exps.weight` -> (3, "up"); None for any other tensor."""
    m = _STACK.match(name)
    return (int(m[1]), m[2]) if m else None


def check_stacks(gf: GGUFFile, stacks: Stacks) -> None:
    """Every MoE layer has its three stacks."""
    for layer, stack in sorted(stacks.items()):
        missing = [f"ffn_{p}_exps" for p in PROJECTIONS if p not in stack]
        if missing:
            have = [f"ffn_{p}_exps" for p in PROJECTIONS if p in stack]
            raise ModelFormatError(f"{gf.path.name}: layer {layer} has {have} but not {missing}; the GGUF is "
                                   "incomplete")


def float_experts(layer: int, stack: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """One layer's stacks dequantized under HF's names: gate and up joined into `experts.gate_up_proj`."""
    prefix = f"model.layers.{layer}.mlp.experts"
    yield f"{prefix}.gate_up_proj", np.concatenate([dequantize_tensor(stack["gate"]), dequantize_tensor(stack["up"])],
                                                   axis=1)
    yield f"{prefix}.down_proj", dequantize_tensor(stack["down"])


def glm4_moe_tensor_name(gguf_name: str, first_moe_layer: int) -> str | None:
    """`blk.1.ffn_gate_inp.weight` -> `model.layers.1.mlp.gate.weight`; None for names with no HF counterpart
    (the stacked experts: `stacked_projection`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in TOP_LEVEL_NAMES and suffix == "weight":
        return f"{TOP_LEVEL_NAMES[stem]}.weight"
    m = _LAYER.match(gguf_name)
    if m is None:
        return None
    layer, kind, suffix = int(m[1]), m[2], m[3]
    prefix = f"model.layers.{layer}."
    if kind in ATTENTION_NAMES:
        return f"{prefix}{ATTENTION_NAMES[kind]}.{suffix}"
    if layer < first_moe_layer:
        return f"{prefix}{DENSE_NAMES[kind]}.{suffix}" if kind in DENSE_NAMES and suffix == "weight" else None
    if kind == "exp_probs_b":
        return prefix + MOE_NAMES[kind] if suffix == "bias" else None
    return prefix + MOE_NAMES[kind] if kind in MOE_NAMES and suffix == "weight" else None


def iter_glm4_moe_tensors(gf: GGUFFile, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 array) for every tensor of the decoder layers; NextN layers are skipped undecoded, and each
    layer's stacked experts become `experts.gate_up_proj` and `experts.down_proj` once all three are read."""
    n_layers, first_moe = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    stacks: Stacks = {}
    for t in gf.reader.tensors:
        m = _LAYER.match(t.name)
        if m and int(m[1]) >= n_layers:
            continue  # multi-token-prediction layer: only speculative decoding would use it
        if (stacked := stacked_projection(t.name)) is not None:
            stack = stacks.setdefault(stacked[0], {})
            stack[stacked[1]] = t
            if len(stack) == len(PROJECTIONS):
                yield from float_experts(stacked[0], stacks.pop(stacked[0]))
            continue
        name = glm4_moe_tensor_name(t.name, first_moe)
        if name is None:
            raise ModelFormatError(
                f"{gf.path.name}: tensor {t.name!r} has no place in a glm4moe model with {first_moe} leading dense "
                "layer(s); this GGUF holds a variant mlc does not convert"
            )
        yield name, dequantize_tensor(t)
    check_stacks(gf, stacks)  # a layer still here lacks a stack
