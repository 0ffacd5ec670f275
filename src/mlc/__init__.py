"""mlc: serve and fine-tune GLM-family and Llama-style language models.

`from mlc import LLM, SamplingParams` is the offline API, as in vLLM; the names load torch on first use only, so
`import mlc` (and the CLI's start) stays light.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "mlc.engine.llm",
    "SamplingParams": "mlc.engine.sampling_params",
    "EngineConfig": "mlc.config.engine_config",
}
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mlc' has no attribute {name!r}")
