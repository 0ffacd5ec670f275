"""Benchmarks as measurements: load generation against a server, offline throughput, KV and quantization trade-offs,
and side-by-side comparisons with llama.cpp and transformers (`compare`). Speed claims come from these, never from
tests."""
