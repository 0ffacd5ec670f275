"""A tiny random Llama checkpoint with a ChatML tokenizer, for fast training tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello, thank you for contacting us. Your order has shipped and will arrive soon.",
    "您好，感谢您的耐心等待。订单已发货，请注意查收。",
    "How do I reset my password? Where is my refund? Can I change the address?",
    "user assistant system 0123456789 ?!.,:;'\"()[]{}",
]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        chat_template=CHATML,
    )
    fast.save_pretrained(str(out))
    return fast


def build_tiny_llama(out: Path, seed: int = 0, hidden_size: int = 32) -> Path:
    """config.json + model.safetensors + tokenizer files of a 2-layer Llama (hidden 32 unless asked), weights
    random."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    return out
