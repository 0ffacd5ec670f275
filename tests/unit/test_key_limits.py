"""Per-key limits at admission (server/tenants.py) on a fake clock: requests and tokens per rolling minute, requests
in flight, Retry-After as the seconds until the window lets the request in, the token charge corrected to the real
use, and the per-key counters in the metrics registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mlc.errors import RequestTooLargeError
from mlc.server.keys import KeyEntry, hash_key
from mlc.server.tenants import RateLimitError, Tenants


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def setup(**limits) -> tuple[Tenants, KeyEntry, Clock, CollectorRegistry]:
    clock, registry = Clock(), CollectorRegistry()
    return Tenants(registry, "m", clock), KeyEntry(name="a", key_sha256=hash_key("k"), **limits), clock, registry


def refused(tenants: Tenants, entry: KeyEntry, prompt: int = 10, max_tokens: int = 10) -> RateLimitError:
    with pytest.raises(RateLimitError) as e:
        tenants.admit(entry, prompt, max_tokens)
    assert e.value.http_status == 429
    return e.value


def test_requests_per_minute_and_retry_after():
    tenants, entry, clock, registry = setup(requests_per_minute=2)
    tenants.admit(entry, 10, 10).release(5)
    clock.t += 20
    tenants.admit(entry, 10, 10).release(5)
    clock.t += 10
    err = refused(tenants, entry)
    assert (err.field, err.retry_after, err.error_type) == ("requests_per_minute", 30, "rate_limit_exceeded")
    assert "key 'a'" in err.message and "limit is 2" in err.message
    clock.t += 30  # the first request leaves the window
    tenants.admit(entry, 10, 10)
    assert registry.get_sample_value("mlc:key_rate_limited_total",
                                     {"model_name": "m", "key": "a", "limit": "requests_per_minute"}) == 1
    assert registry.get_sample_value("mlc:key_requests_total", {"model_name": "m", "key": "a"}) == 3


def test_tokens_per_minute_charges_max_tokens_then_the_real_use():
    tenants, entry, clock, registry = setup(tokens_per_minute=1000)
    first = tenants.admit(entry, 100, 500)  # charged 600 while it runs
    clock.t += 5
    err = refused(tenants, entry, 100, 400)  # 600 + 500 > 1000
    assert (err.field, err.retry_after) == ("tokens_per_minute", 55)
    first.release(20)  # it stopped after 20 tokens: its charge is now 120
    tenants.admit(entry, 100, 400)  # 120 + 500 fits
    assert registry.get_sample_value("mlc:key_tokens_total", {"model_name": "m", "key": "a", "kind": "prompt"}) == 100
    assert registry.get_sample_value("mlc:key_tokens_total",
                                     {"model_name": "m", "key": "a", "kind": "completion"}) == 20


def test_a_request_over_the_whole_minute_is_a_400_not_a_retry():
    tenants, entry, _, _ = setup(tokens_per_minute=100)
    with pytest.raises(RequestTooLargeError, match="more than key 'a' may use in a minute"):
        tenants.admit(entry, 50, 60)


def test_max_concurrent_counts_requests_in_flight():
    tenants, entry, _, registry = setup(max_concurrent=2)
    a, _ = tenants.admit(entry, 1, 1), tenants.admit(entry, 1, 1)
    assert registry.get_sample_value("mlc:key_requests_in_flight", {"model_name": "m", "key": "a"}) == 2
    assert refused(tenants, entry).field == "max_concurrent"
    a.release(1)
    a.release(1)  # idempotent
    tenants.admit(entry, 1, 1)
    assert registry.get_sample_value("mlc:key_requests_in_flight", {"model_name": "m", "key": "a"}) == 2


def test_a_key_without_limits_is_only_counted():
    tenants, entry, _, registry = setup()
    for _ in range(100):
        tenants.admit(entry, 1000, 1000)
    assert registry.get_sample_value("mlc:key_requests_in_flight", {"model_name": "m", "key": "a"}) == 100
