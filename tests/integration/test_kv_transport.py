"""The KV transfer across two processes: a prefill engine in a child process leases a prompt's pages and sends them
over its own gloo pair group (`engine/kv_transport.py`); the decode engine here pulls them and continues token for
token as one engine would. A prefill process killed with pages leased leaves the decoder to recompute the prompt."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from mlc.config.engine_config import EngineConfig
from mlc.engine.kv_transfer import KVHandle, pack_bytes
from mlc.engine.kv_transport import KVReceiver, KVSender
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from tests.numerics.test_decode_parity import PAGE_SIZE, build_checkpoint
from tests.unit.test_kv_transfer import greedy, run


def engine(path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=8 << 20))


def prefill_process(path: str, prompt: list[int], inbox, outbox) -> None:
    """P: prefill, answer with the handle and its store address, send what the decoder asks for, release."""
    p = engine(path)
    sender = KVSender(timeout=10)
    p.prefill_for_transfer("r", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    run(p, "r")
    handle = p.kv_handle("r")
    assert handle is not None
    handle.address = sender.address
    outbox.put(handle.to_dict())
    while (msg := inbox.get()) is not None:
        pair, tag, skip = msg
        if skip < 0:
            return  # told to die with the lease held
        sender.send(pair, tag, p.export_kv("r", skip)).result(timeout=30)
        outbox.put(p.release_kv("r"))


@pytest.fixture
def child(tmp_path):
    path = build_checkpoint("llama", tmp_path)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    prompt = list(range(10, 10 + 3 * PAGE_SIZE + 5))
    proc = ctx.Process(target=prefill_process, args=(str(path), prompt, inbox, outbox), daemon=True)
    proc.start()
    yield path, prompt, proc, inbox, outbox
    inbox.put(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def test_two_process_transfer_over_gloo_matches_one_engine(child):
    path, prompt, _, inbox, outbox = child
    d = engine(path)
    handle = KVHandle.from_dict(outbox.get(timeout=120))
    pending = d.begin_import("r", prompt, greedy(), handle)
    assert pending is not None and len(pending.src_pages) == handle.num_tokens // PAGE_SIZE + 1
    receiver = KVReceiver(timeout=10)
    tag = receiver.next_tag()
    inbox.put((receiver.pair_id(handle.address), tag, pending.hit_pages))
    buf = receiver.recv(handle.address, tag, pack_bytes(d.kv_cache, len(pending.src_pages)))
    assert outbox.get(timeout=30) is True  # P released its lease after the pull
    d.finish_import("r", buf)
    got = run(d, "r")
    d.add_request("alone", prompt, greedy())
    assert got == run(d, "alone")
    assert d.kv.stats.imports == 1


def test_prefill_process_killed_with_pages_leased_makes_the_decoder_recompute(child):
    path, prompt, proc, inbox, outbox = child
    d = engine(path)
    handle = KVHandle.from_dict(outbox.get(timeout=120))
    pending = d.begin_import("r", prompt, greedy(), handle)
    assert pending is not None
    receiver = KVReceiver(timeout=5)
    tag = receiver.next_tag()
    inbox.put((receiver.pair_id(handle.address), tag, -1))
    proc.join(30)
    with pytest.raises(Exception):  # noqa: B017 - gloo raises RuntimeError or a DistStoreError
        receiver.recv(handle.address, tag, 1024)
    d.finish_import("r", None)
    got = run(d, "r")
    d.add_request("alone", prompt, greedy())
    assert got == run(d, "alone") and d.kv.stats.imports_recomputed == 1
    assert d.recovery.audit() == []


def test_bench_pd_transfer_reports_every_phase(tmp_path):
    from mlc.bench.pd import run_transfer

    path = build_checkpoint("llama", tmp_path)
    report = run_transfer(EngineConfig(model=str(path), dtype="fp32", page_size=PAGE_SIZE), context=100, reps=2)
    assert report.prefilled and report.context_tokens == 100 and report.pages == 7
    engine_bytes = report.bytes // (report.pages * PAGE_SIZE)
    assert engine_bytes > 0 and report.bytes == engine_bytes * report.pages * PAGE_SIZE
    out = report.to_json()
    assert all(out[k] > 0 for k in ("pack_ms", "gloo_ms", "unpack_ms", "memcpy_ms", "effective_gb_s"))
