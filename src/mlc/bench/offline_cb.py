"""transformers' own continuous batching (`model.generate_batch`, fp32, its defaults) on the same prompts as
`bench offline`: a peer for `bench compare`."""

from __future__ import annotations

import time

import torch


def run_transformers_cb(model_dir, ids: list[list[int]], max_new_tokens: int, pad_token_id: int = 0) -> dict:
    """Output tok/s of `generate_batch` over the prompts `ids` (token lists), greedy, exactly max_new_tokens each."""
    from transformers import GenerationConfig

    from mlc.models.hf_checkpoint import transformers_model

    net = transformers_model(model_dir).eval()
    pad = pad_token_id
    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=pad)
    with torch.inference_mode():
        net.generate_batch(ids[:2], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, pad_token_id=pad), progress_bar=False)
        start = time.perf_counter()
        out = net.generate_batch(ids, generation_config=gen, progress_bar=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    failed = [rid for rid, o in out.items() if getattr(o, "error", None) or len(o.generated_tokens) != max_new_tokens]
    if len(out) != len(ids) or failed:  # its failures are logged, not raised: never report them as a speed
        raise RuntimeError(f"transformers generate_batch failed on {len(failed) or len(ids) - len(out)} of "
                           f"{len(ids)} requests (see its log above)")
    return {"label": "transformers generate_batch (continuous batching)", "requests": len(ids),
            "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else 0.0}
