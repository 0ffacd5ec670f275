"""Engine layer: sequences, page manager, scheduler, KV cache, model runner, sampler, LLM and AsyncEngine."""
