"""Rebuild an HF tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json) from GGUF metadata.

Byte-level BPE (`tokenizer.ggml.model == 'gpt2'`) is rebuilt from tokens + merges with the pre-tokenizer that
`tokenizer.ggml.pre` names; SentencePiece BPE (`'llama'`) from tokens + scores with byte fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mlc.errors import ModelFormatError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from mlc.models.gguf.reader import GGUFFile

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2_pre():
    """StarCoder/SmolLM: every digit on its own (llama.cpp's `\\p{N}` pass), then GPT-2's regex."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_then_bytes(regex: str) -> Callable[[], Any]:
    def build():
        from tokenizers import Regex, pre_tokenizers

        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])

    return build


# `tokenizer.ggml.pre` -> pre-tokenizer, grouped as llama.cpp groups its regexes (llama-vocab.cpp)
BYTE_LEVEL_PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    **dict.fromkeys(["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "jina-es", "jina-de",
                     "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code"], _gpt2_pre),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _digits_then_gpt2_pre),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe", "chatglm-bpe",
                     "glm4"],
                    _split_then_bytes(LLAMA3_SPLIT)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _split_then_bytes(QWEN2_SPLIT)),
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level vocabularies are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _metadata(gf: GGUFFile, key: str, default: Any = None) -> Any:
    return gf.metadata.get(f"tokenizer.ggml.{key}", default)


def _tokens(gf: GGUFFile) -> tuple[list[str], list[int]]:
    tokens = _metadata(gf, "tokens")
    if not tokens:
        raise ModelFormatError(f"{gf.path.name}: no tokenizer.ggml.tokens; this GGUF carries no tokenizer")
    types = _metadata(gf, "token_type") or [NORMAL] * len(tokens)
    return [str(t) for t in tokens], [int(t) for t in types]


def _added_tokens(tokens: list[str], types: list[int]) -> list:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens (matched whole)."""
    from tokenizers import AddedToken

    return [
        AddedToken(tok, special=kind != USER_DEFINED, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind in (CONTROL, UNKNOWN, USER_DEFINED)
    ]


def _vocab(tokens: list[str], spell: Callable[[str], str] | None = None) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(spell(tok) if spell else tok, i)
    return vocab


def _post_processor(gf: GGUFFile, tokens: list[str], fallback):
    """Add BOS/EOS when the GGUF says llama.cpp adds them; otherwise `fallback`."""
    from tokenizers import processors

    pieces = []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        token_id = _metadata(gf, key)
        pieces.append((tokens[token_id], token_id) if _metadata(gf, flag) and token_id is not None else None)
    bos, eos = pieces
    if bos is None and eos is None:
        return fallback
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[p for p in pieces if p])


def byte_level_tokenizer(gf: GGUFFile) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, processors

    pre_name = str(_metadata(gf, "pre", "gpt2"))
    if pre_name not in BYTE_LEVEL_PRE_TOKENIZERS:
        raise ModelFormatError(
            f"{gf.path.name}: pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not known to mlc; known: "
            f"{', '.join(sorted(BYTE_LEVEL_PRE_TOKENIZERS))}. Use the model's HF checkpoint (with tokenizer.json)"
        )
    tokens, types = _tokens(gf)
    merges = _metadata(gf, "merges")
    if not merges:
        raise ModelFormatError(f"{gf.path.name}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def spell(tok: str) -> str:
        return tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8"))

    # added tokens keep their literal text in the vocab so that adding them finds their id instead of appending one
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        vocab.setdefault(tok if kind in (CONTROL, UNKNOWN, USER_DEFINED) else spell(tok), i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = BYTE_LEVEL_PRE_TOKENIZERS[pre_name]()
    tk.decoder = decoders.ByteLevel()  # the decoder takes no options (keywords given to it were ignored)
    tk.post_processor = _post_processor(gf, tokens, processors.ByteLevel(trim_offsets=False))
    tk.add_special_tokens([t for t in _added_tokens(tokens, types) if t.special])
    tk.add_tokens([t for t in _added_tokens(tokens, types) if not t.special])
    return tk


def sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: a token splits into two vocabulary pieces, and merges
    rank by the merged token's score (higher first), as SentencePiece's BPE applies them."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in scores.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def sentencepiece_tokenizer(gf: GGUFFile) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, types = _tokens(gf)
    raw_scores = _metadata(gf, "scores")
    if raw_scores is None:
        raise ModelFormatError(f"{gf.path.name}: SentencePiece tokenizer without tokenizer.ggml.scores")
    vocab = _vocab(tokens)
    # control, byte and unused pieces never come out of a merge
    scores = {tok: float(s) for tok, s, kind in zip(tokens, raw_scores, types) if kind in (NORMAL, USER_DEFINED)}
    unk_id = _metadata(gf, "unknown_token_id")
    tk = Tokenizer(models.BPE(
        vocab=vocab, merges=sentencepiece_merges(vocab, scores), dropout=None,
        unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True, byte_fallback=True,
    ))
    add_prefix = bool(_metadata(gf, "add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    tk.post_processor = _post_processor(gf, tokens, None)
    tk.add_special_tokens([t for t in _added_tokens(tokens, types) if t.special])
    tk.add_tokens([t for t in _added_tokens(tokens, types) if not t.special])
    return tk


TOKENIZER_BUILDERS = {"gpt2": byte_level_tokenizer, "llama": sentencepiece_tokenizer}


def build_tokenizer(gf: GGUFFile) -> Tokenizer:
    kind = str(_metadata(gf, "model", "<missing>"))
    if kind not in TOKENIZER_BUILDERS:
        raise ModelFormatError(
            f"{gf.path.name}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; mlc rebuilds "
            f"{', '.join(TOKENIZER_BUILDERS)} tokenizers. Use the model's HF checkpoint (with tokenizer.json)"
        )
    return TOKENIZER_BUILDERS[kind](gf)


def special_tokens(gf: GGUFFile) -> dict[str, str]:
    tokens, _ = _tokens(gf)
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = _metadata(gf, key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            out[name] = tokens[int(token_id)]
    return out


def tokenizer_config(gf: GGUFFile) -> dict[str, Any]:
    tokens, types = _tokens(gf)
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(gf),
        "add_bos_token": bool(_metadata(gf, "add_bos_token", _metadata(gf, "model") == "llama")),
        "add_eos_token": bool(_metadata(gf, "add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gf.arch_key("context_length") or 4096),
    }
    template = gf.metadata.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = str(template)
    return cfg
