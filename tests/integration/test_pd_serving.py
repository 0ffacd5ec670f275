"""Prefill/decode disaggregation through real servers: `serve --kv-role prefill` and `serve --kv-role decode`
(the default model), the PD router in front of them. Greedy answers through the router (the prompt prefilled on P,
its KV pulled over gloo by D) equal D's own; short prompts stay on D; the transfer shows in /metrics; a request sent
the wrong way is refused with a clear error."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlc.cluster.pd_router import PDRouter
from mlc.server.pd import HANDLE_HEADER, PREFILL_HEADER, decode_handle, encode_handle
from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow

LONG = ("Here are some facts about European capitals and rivers. " * 12) + "Name the capital of France."


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory):
    p = ServerProcess(tmp_path_factory.mktemp("p"), ["--kv-role", "prefill"])
    d = ServerProcess(tmp_path_factory.mktemp("d"), ["--kv-role", "decode"])
    with p, d:
        yield p, d


def asks(router: PDRouter, *calls: tuple[str, dict]) -> list[httpx.Response]:
    """POST each (path, body) through the router in turn, on one event loop (its client lives on it)."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://pd",
                                     timeout=120) as client:
            return [await client.post(path, json=body) for path, body in calls]

    return asyncio.run(go())


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0, **kw}


def test_router_answers_equal_the_decoders_own(pd_pair):
    p, d = pd_pair
    want = httpx.post(d.url + "/v1/chat/completions", json=chat(LONG), timeout=120).json()
    router = PDRouter([p.url], [d.url], threshold_tokens=32)
    got, stream, short = asks(router, ("/v1/chat/completions", chat(LONG)),
                              ("/v1/chat/completions", chat(LONG, stream=True)), ("/v1/chat/completions", chat("Hi")))
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want["choices"][0]["message"]
    assert router.routed["remote"] == 2
    m = d.metrics()
    assert m['mlc:kv_transfer_imports_total{model_name="smollm2-135m-instruct"}'] == 2
    assert m['mlc:kv_transfer_received_bytes_total{model_name="smollm2-135m-instruct"}'] > 0
    assert p.metrics()['mlc:kv_leases{model_name="smollm2-135m-instruct"}'] == 0  # released after the pull
    # streamed, and through the completions API: the same tokens
    assert stream.status_code == 200 and "[DONE]" in stream.text
    text = "".join(line for line in stream.text.splitlines() if '"content"' in line)
    assert want["choices"][0]["message"]["content"].split()[0] in text
    assert short.status_code == 200 and router.routed["local"] == 1
    assert 'mlc_pd_pool_in_flight{pool="decode"} 0' in router.metrics_text()


def test_prefill_returns_a_handle_and_roles_refuse_the_wrong_request(pd_pair):
    p, d = pd_pair
    r = httpx.post(p.url + "/v1/chat/completions", json=chat(LONG), headers={PREFILL_HEADER: "1"}, timeout=120)
    handle = decode_handle(r.headers[HANDLE_HEADER])
    assert r.json()["usage"]["completion_tokens"] == 1 and handle.num_tokens == r.json()["usage"]["prompt_tokens"]
    assert handle.store and handle.page_ids
    assert httpx.post(p.url + "/v1/kv/release", json={"request_id": handle.request_id}).json() == {"released": True}
    gone = httpx.post(p.url + "/v1/kv/pull", json={"request_id": handle.request_id, "pair": "x", "tag": 1})
    assert gone.status_code == 410 and "compute the prompt on the decode instance" in gone.text
    wrong = httpx.post(d.url + "/v1/chat/completions", json=chat(LONG), headers={PREFILL_HEADER: "1"})
    assert wrong.status_code == 400 and "--kv-role decode" in wrong.text


def test_a_dead_prefill_handle_makes_the_decoder_recompute(pd_pair):
    p, d = pd_pair
    r = httpx.post(p.url + "/v1/chat/completions", json=chat(LONG), headers={PREFILL_HEADER: "1"}, timeout=120)
    handle = decode_handle(r.headers[HANDLE_HEADER])
    httpx.post(p.url + "/v1/kv/release", json={"request_id": handle.request_id})  # the lease is gone
    handle.address = p.url
    got = httpx.post(d.url + "/v1/chat/completions", json=chat(LONG), timeout=120,
                     headers={HANDLE_HEADER: encode_handle(handle.to_dict())})
    want = httpx.post(d.url + "/v1/chat/completions", json=chat(LONG), timeout=120).json()
    assert got.status_code == 200 and got.json()["choices"][0]["message"] == want["choices"][0]["message"]
    assert d.metrics()['mlc:kv_transfer_recomputed_total{model_name="smollm2-135m-instruct"}'] >= 1
