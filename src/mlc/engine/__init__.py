"""Engine layer: sequences, block manager, scheduler, KV cache, model runner, sampler, LLM and AsyncEngine."""
