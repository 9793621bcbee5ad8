"""Who a request comes from, for what is shared out per client (the rate limit, the compute slots)."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass

from starlette.types import Scope

from foundation import defaults


@dataclass(frozen=True)
class Clients:
    """How requests are told apart: by the configured API key (``api_key``), else by the network of their
    address, ``ipv4_prefix`` or ``ipv6_prefix`` bits wide. One host is given a whole IPv6 /64 (often a /56
    or a /48), so counting each IPv6 address as a client would give one attacker as many fair shares and
    rate-limit buckets as it cares to use addresses."""

    api_key: str | None = None
    ipv4_prefix: int = defaults.CLIENT_IPV4_PREFIX
    ipv6_prefix: int = defaults.CLIENT_IPV6_PREFIX

    def __post_init__(self) -> None:
        if not (0 <= self.ipv4_prefix <= 32 and 0 <= self.ipv6_prefix <= 128):
            raise ValueError(
                f"client network prefixes are 0-32 bits (IPv4) and 0-128 (IPv6), got {self.ipv4_prefix} "
                f"and {self.ipv6_prefix}"
            )

    def key(self, scope: Scope) -> str:
        """The API key when the request presents the configured one (so key holders behind one proxy count
        as one client), else the network of the client's address: the proxy's forwarded address when the
        proxy is trusted (``trusted_proxies``: uvicorn has put it in the scope). An unknown key is not a
        client of its own: otherwise a client could count as a new one with every made-up key."""
        presented = dict(scope["headers"]).get(b"x-api-key")
        if (
            self.api_key
            and presented is not None
            and secrets.compare_digest(presented, self.api_key.encode())
        ):
            return "api-key"
        client = scope.get("client")
        return f"address:{self.network(client[0]) if client else 'unknown'}"

    def network(self, address: str) -> str:
        """``address``'s network as one client (an IPv4 address mapped into IPv6 counts as IPv4); a host
        that is not an IP address (a Unix socket's peer, a test client's name) as it is."""
        try:
            ip = ipaddress.ip_address(address.partition("%")[0])  # without a link-local zone ("%eth0")
        except ValueError:
            return address
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        prefix = self.ipv4_prefix if ip.version == 4 else self.ipv6_prefix
        return str(ipaddress.ip_network((ip, prefix), strict=False))
