"""Who a request comes from, for what is shared out per client (the rate limit, the compute slots)."""

from __future__ import annotations

import secrets

from starlette.types import Scope


def client_key(scope: Scope, api_key: bytes | None) -> str:
    """The API key when the request presents the configured one (so key holders behind one proxy count as
    one client), else the client's address: the proxy's forwarded address when the proxy is trusted
    (``trusted_proxies``: uvicorn has put it in the scope). An unknown key is not a client of its own:
    otherwise a client could count as a new one with every made-up key."""
    presented = dict(scope["headers"]).get(b"x-api-key")
    if api_key is not None and presented is not None and secrets.compare_digest(presented, api_key):
        return "api-key"
    client = scope.get("client")
    return f"address:{client[0] if client else 'unknown'}"
