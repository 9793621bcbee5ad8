"""``dmlsearch serve`` in a real uvicorn process on a free port (started and awaited by
``bench.lib.servers``), and the fault suite's capped server."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.lib.servers import ServerProcess, serving
from tests.support.served import Served

# The API key of the servers and apps the tests start with writes enabled.
API_KEY = "test-key-0123456789"

# The fault suite's memory cap (``prlimit --as``): a served process's whole address space, mappings of
# onnxruntime and FAISS included (an idle server maps ~0.9 GB of it).
ADDRESS_SPACE_CAP = 2 * 1024**3


def serve_args(served: Served, *extra: str) -> list[str]:
    """``serve``'s arguments for a served copy: its index and model, then ``extra``."""
    return ["--index", str(served.index), "--model", str(served.model), *extra]


@contextmanager
def capped_serving(
    served: Served,
    *extra: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    ready_path: str = "/readyz",
) -> Iterator[ServerProcess]:
    """The fault suite's server: ``serve`` over ``served`` (``extra`` arguments), writes enabled with
    :data:`API_KEY`, under the :data:`ADDRESS_SPACE_CAP` memory cap."""
    env = {"DMLSEARCH_API_KEY": API_KEY, **(env or {})}
    args = serve_args(served, *extra)
    with serving(args, env, ready_path, address_space=ADDRESS_SPACE_CAP, log=log) as server:
        yield server


def search(server: ServerProcess, data: bytes, timeout: float = 120, **params: object) -> httpx.Response:
    """``POST /v1/search`` of one image (``params``: the query string)."""
    files = {"image": ("q", data)}
    return httpx.post(f"{server.url}/v1/search", params=params, files=files, timeout=timeout)


@contextmanager
def uvicorn_server(
    args: list[str], env: dict[str, str] | None = None, ready_path: str = "/readyz", **options: object
) -> Iterator[str]:
    """``dmlsearch serve ARGS`` in a real uvicorn process on a free port; yields its base URL.

    Waits until ``ready_path`` answers 200 (``/healthz`` for servers that are meant not to be ready).
    """
    with serving(args, env, ready_path, **options) as server:
        yield server.url


@contextmanager
def uvicorn_process(
    args: list[str], env: dict[str, str] | None = None, ready_path: str = "/readyz", **options: object
) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`uvicorn_server` that also yields the process (to send it signals)."""
    with serving(args, env, ready_path, **options) as server:
        yield server.url, server.process
