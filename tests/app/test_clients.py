"""Who a request comes from: the API key, else the network of its address (an IPv6 /64 is one client)."""

from __future__ import annotations

import httpx
import pytest

from app.clients import Clients
from app.settings import Settings
from tests.support.served import Served
from tests.support.servers import capped_serving


def scope(address: str | None, key: str | None = None) -> dict:
    headers = [(b"x-api-key", key.encode())] if key else []
    return {"type": "http", "headers": headers, "client": (address, 5) if address else None}


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        ("2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff", True),  # one /64
        ("2001:db8:1:2::1", "2001:db8:1:3::1", False),  # the next /64
        ("2001:DB8:1:2:0:0:0:1", "2001:db8:1:2::1", True),  # one address, spelt two ways
        ("fe80::1%eth0", "fe80::2%eth1", True),  # link-local, zones aside
        ("10.0.0.1", "10.0.0.2", False),  # IPv4: one address each
        ("::ffff:10.0.0.1", "10.0.0.1", True),  # IPv4 mapped into IPv6 is that IPv4 address
        ("::ffff:10.0.0.1", "::ffff:10.0.0.2", False),  # and not one /64 of mapped addresses
        ("testclient", "testclient", True),  # not an IP address: as it is
    ],
)
def test_addresses_are_grouped_by_their_network(first: str, second: str, same: bool) -> None:
    clients = Clients()
    assert (clients.key(scope(first)) == clients.key(scope(second))) is same


def test_the_network_widths_are_settings_and_the_key_goes_first() -> None:
    wide = Settings(client_ipv4_prefix=24, client_ipv6_prefix=48).clients()
    assert (
        wide.key(scope("2001:db8:1:2::1"))
        == wide.key(scope("2001:db8:1:ffff::1"))
        == "address:2001:db8:1::/48"
    )
    assert wide.key(scope("10.0.0.1")) == wide.key(scope("10.0.0.254")) != wide.key(scope("10.0.1.1"))
    keyed = Clients(api_key="secret")
    assert keyed.key(scope("10.0.0.1", "secret")) == keyed.key(scope("2001:db8::1", "secret")) == "api-key"
    assert keyed.key(scope("10.0.0.1", "guessed")) == "address:10.0.0.1/32"
    assert Clients().key(scope(None)) == "address:unknown"
    with pytest.raises(ValueError, match="0-128"):
        Clients(ipv6_prefix=129)


@pytest.mark.server
def test_forwarded_ipv6_addresses_of_one_network_share_one_rate_limit_bucket(served: Served) -> None:
    """Issue 43, leftover: through a trusted proxy (uvicorn puts the forwarded address in the scope), every
    new IPv6 address of one /64 had a bucket of its own: 8 requests from 8 addresses, 8 x 200 with a burst
    of 3. The grouping reads the same address the proxy handling does: now the /64 shares one bucket, and
    another /64 has its own."""
    limits = ["--rate-limit", "0.01", "--rate-burst", "3", "--trusted-proxy", "127.0.0.1"]
    with capped_serving(served, *limits) as server:

        def stats(address: str) -> int:
            headers = {"X-Forwarded-For": address}
            return httpx.get(f"{server.url}/v1/stats", headers=headers, timeout=30).status_code

        one_network = [stats(f"2001:db8:66:1:{number:x}::{number + 1:x}") for number in range(8)]
        assert one_network == [200] * 3 + [429] * 5
        assert stats("2001:db8:66:2::1") == 200  # the next /64: a client of its own
