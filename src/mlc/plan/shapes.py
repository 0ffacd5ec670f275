"""Built-in model shapes, written from the public config.json of each checkpoint, so `plan` works without weights.

`PUBLISHED` is the parameter count each model card states (total, and active per token for MoE), what the
architecture built from the shape must count to within a few percent (MTP layers excluded).
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct, the default model
    "smollm2-135m-instruct": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "dtype": "bfloat16",
    },
    # THUDM/glm-4-9b-chat-hf
    "glm-4-9b": {
        "model_type": "glm", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-07, "attention_bias": True,
        "pad_token_id": 151329, "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    # zai-org/GLM-4.5
    "glm-4.5": {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 160, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1,
        "pad_token_id": 151329, "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    },
    # zai-org/GLM-4.5-Air
    "glm-4.5-air": {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "use_qk_norm": False, "attention_bias": True,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1,
        "pad_token_id": 151329, "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    },
    # zai-org/GLM-5
    "glm-5": {
        "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1,
        "pad_token_id": 154820, "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}

# (total, active per token) parameters as the model cards state them.
PUBLISHED: dict[str, tuple[float, float]] = {
    "smollm2-135m-instruct": (135e6, 135e6),
    "glm-4-9b": (9.4e9, 9.4e9),
    "glm-4.5": (355e9, 32e9),
    "glm-4.5-air": (106e9, 12e9),
    "glm-5": (744e9, 40e9),
}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def hf_config_for(values: dict[str, Any]):
    """A transformers config object from config.json values (its defaults fill what the values leave out)."""
    from transformers import CONFIG_MAPPING

    values = dict(values)
    model_type = values.pop("model_type")
    return CONFIG_MAPPING[model_type](**values)
