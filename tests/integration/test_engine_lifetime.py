"""An engine let go is freed at once, without waiting for the garbage collector: nothing it owns points back at it.
A tensor-parallel or pipelined engine's workers (and the process's default process group) go with it, so the next
engine in the same process can start its own."""

from __future__ import annotations

import gc
import weakref

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from tests.support.tiny_llama import build_tiny_llama


def test_an_engine_let_go_is_freed_without_the_garbage_collector(tmp_path):
    model_dir = build_tiny_llama(tmp_path / "m")
    gc.disable()
    try:
        llm = LLM(str(model_dir), kv_cache_memory="1MiB")
        llm.generate(["hello"], SamplingParams(max_new_tokens=2))
        gone = weakref.ref(llm.engine)
        del llm
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        gc.enable()
