"""Tiny random GLM-4 (glm4) and GLM-4.5 (glm4_moe) checkpoints with a GLM-style tokenizer and no chat template, so
they get mlc's built-in templates: for tool calling, reasoning and structured outputs through the real server."""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# GLM-4.5's tool and reasoning tags are added tokens that decode as text (not special), as in its tokenizer.
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>", "<tool_response>", "</tool_response>"]
CORPUS = [
    "What is the weather in Paris? Let me check the forecast for you.",
    'get_weather\n{"city": "Paris", "days": 3}',
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "active": true}',
    "北京和上海今天的天气情况 0123456789 ?!.,:;'\"()[]{}<>/_-",
]


def build_glm_tokenizer(out: Path, tags: bool):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    if tags:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return fast


def _eos(tok) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]


def build_tiny_glm(out: Path, moe: bool, seed: int = 0) -> Path:
    """config.json + safetensors + tokenizer of a 2-layer random GLM-4 (moe=False) or GLM-4.5 (moe=True)."""
    import torch
    from transformers import Glm4Config, Glm4ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_glm_tokenizer(out, tags=moe)
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, attention_bias=True, rms_norm_eps=1e-5,
                  max_position_embeddings=4096, pad_token_id=tok.pad_token_id, eos_token_id=_eos(tok),
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if moe:
        cfg = Glm4MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                            first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True)
        model_cls = Glm4MoeForCausalLM
    else:
        cfg = Glm4Config(**common, intermediate_size=128)
        model_cls = Glm4ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    return out
