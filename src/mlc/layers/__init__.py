"""Model building blocks: norms, rotary embeddings, linear layers, paged attention, MoE."""
