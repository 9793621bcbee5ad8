"""The app in process, over settings a test chooses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def app_clients(defaults: dict[str, object]) -> Iterator[Callable[..., object]]:
    """``make(**overrides)`` builds an in-process app over ``Settings(**defaults, **overrides)``; every
    client made is closed on exit."""
    from fastapi.testclient import TestClient

    from app.api import create_app
    from app.settings import Settings

    clients: list[TestClient] = []

    def make(**overrides: object) -> TestClient:
        client = TestClient(create_app(Settings(**{**defaults, **overrides})), raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in clients:
            client.__exit__(None, None, None)
