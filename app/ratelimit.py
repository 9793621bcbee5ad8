"""Per-client token buckets: ``rate`` requests per second sustained, bursts of up to ``burst``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TokenBucketLimiter:
    """One token bucket per client key.

    Used from the event loop only (the rate-limit middleware), so it needs no lock. Buckets that have
    refilled completely carry no state worth keeping and are dropped when the table grows past
    ``max_clients``, so a scan from many addresses cannot grow memory without bound.
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 100_000,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_clients = max_clients
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, key: str) -> float:
        """Take one token for ``key``: 0.0 if allowed, else the seconds until a token is available."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_clients:
                self._drop_full_buckets(now)
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    def _drop_full_buckets(self, now: float) -> None:
        full_after = self.burst / self.rate
        self._buckets = {
            key: bucket for key, bucket in self._buckets.items() if now - bucket.updated < full_after
        }
