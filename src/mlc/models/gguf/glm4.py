"""GLM-4-0414 GGUFs (llama.cpp architecture `glm4`): the config and tensor names that differ from llama's.

llama.cpp's converter writes GLM-4's fused `gate_up_proj` as one `ffn_up`, its sandwich norms as
`post_attention_norm` / `post_ffw_norm`, and leaves q/k rows as they are (GLM's rope already rotates adjacent
pairs, llama.cpp's NORM rope), so no rows are un-permuted."""

from __future__ import annotations

from typing import Any

GLM4_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_mlp_layernorm",
}


def glm4_config(cfg: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A llama-shaped config (from the same metadata keys under `glm4.`) turned into HF's Glm4Config."""
    cfg = {**cfg, "architectures": ["Glm4ForCausalLM"], "model_type": "glm4"}
    cfg.pop("mlp_bias", None)
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    # Glm4Config reads partial_rotary_factor from rope_parameters, 0.5 when absent (GLM-4's own value)
    cfg["rope_parameters"] = {"partial_rotary_factor": 1.0, **cfg["rope_parameters"]}
    return cfg
