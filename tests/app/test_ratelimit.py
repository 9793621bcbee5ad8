"""Per-client token buckets, unit and through the app: 429 with Retry-After, buckets per key or address."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from app.ratelimit import TokenBucketLimiter
from tests.support.servers import API_KEY


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_a_burst_then_the_sustained_rate() -> None:
    clock = FakeClock()
    limiter = TokenBucketLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a") == pytest.approx(0.5)  # one token refills in 1 / rate seconds
    assert limiter.acquire("b") == 0.0  # another client has its own bucket
    clock.now += 0.5
    assert limiter.acquire("a") == 0.0
    assert limiter.acquire("a") > 0.0
    clock.now += 100.0
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]  # refills to the burst, no more
    assert limiter.acquire("a") > 0.0


def test_idle_buckets_are_dropped_when_the_table_is_full() -> None:
    clock = FakeClock()
    limiter = TokenBucketLimiter(rate=1.0, burst=2, clock=clock, max_clients=3)
    for key in "abc":
        limiter.acquire(key)
    clock.now += 10.0  # every bucket has refilled: nothing worth remembering
    limiter.acquire("d")
    assert len(limiter._buckets) == 1


def test_the_app_answers_429_with_retry_after(make_client: Callable[..., TestClient]) -> None:
    client = make_client(rate_limit_per_second=0.5, rate_limit_burst=2, api_key=API_KEY)
    statuses = [client.get("/v1/items/3").status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    refused = client.get("/v1/items/3")
    assert refused.json()["error"]["code"] == "rate_limited"
    assert int(refused.headers["Retry-After"]) >= 1
    # Health, readiness and metrics are not limited; the key holder has a bucket of its own.
    assert client.get("/healthz").status_code == client.get("/readyz").status_code == 200
    assert client.get("/v1/items/3", headers={"X-API-Key": API_KEY}).status_code == 200
    # A made-up key does not buy a fresh bucket: it counts as the same address.
    assert client.get("/v1/items/3", headers={"X-API-Key": "made-up"}).status_code == 429
    assert "dmlsearch_rate_limited_total 3.0" in client.get("/metrics").text
