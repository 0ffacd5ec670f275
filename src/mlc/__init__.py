"""mlc: serve and fine-tune GLM-family and Llama-style language models."""

__version__ = "0.1.0"
