"""The GGUF file a benchmark's model comes from, and what its matrices are stored as (every figure says its format)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def gguf_of(model: str) -> Path | None:
    """The GGUF file a model came from: the file itself, or a store model's pinned source."""
    if model.endswith(".gguf") and Path(model).is_file():
        return Path(model)
    from mlc.models.store.known_models import KNOWN_MODELS
    from mlc.models.store.pulling import gguf_source_file

    known = KNOWN_MODELS.get(model)
    if known is None or not getattr(known, "gguf_sha256", None):
        return None
    return gguf_source_file(known)


def gguf_types(path: Path) -> Counter:
    from mlc.models.gguf.dequant import quant_type_name
    from mlc.models.gguf.reader import open_gguf_tensors

    return Counter(quant_type_name(t) for t in open_gguf_tensors(path).reader.tensors if len(t.shape) >= 2)


def describe_types(types: Counter) -> str:
    """'Q4_K (97 Q4_K, 16 Q6_K, 1 Q8_0)': the most common matrix type first."""
    main = types.most_common(1)[0][0] if types else "?"
    return f"{main} ({', '.join(f'{n} {t}' for t, n in types.most_common())})"


def bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads from a GGUF: every matrix once, the token embedding only where it is also
    the (tied) head (a lookup reads one row of it), and of a MoE layer's stacked experts only the share one token
    routes to (`expert_used_count` of `expert_count`)."""
    from mlc.models.gguf.reader import open_gguf_tensors

    gf = open_gguf_tensors(path)
    tensors = gf.reader.tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    routed = int(gf.arch_key("expert_used_count", 0) or 0) / max(1, int(gf.arch_key("expert_count", 1) or 1))
    total = 0.0
    for t in tensors:
        if len(t.shape) == 3 and "_exps." in t.name:
            total += t.data.nbytes * routed
        elif len(t.shape) == 2 and (t.name != "token_embd.weight" or tied):
            total += t.data.nbytes
    return int(total)
