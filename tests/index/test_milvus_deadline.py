"""A Milvus request never outlasts its deadline: against a port that takes connections and never answers
(a server hung with its port open), a call fails with the reason when the request's deadline comes."""

from __future__ import annotations

import re
import socket
import time

import pytest

from foundation.deadline import request_deadline
from index.protocol import BackendUnavailableError

pytest.importorskip("pymilvus")


def test_a_call_to_a_server_that_never_answers_fails_at_the_requests_deadline() -> None:
    from index.milvus_backend import _open_client

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections are taken by the kernel, and nothing ever answers them
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        server = _open_client(uri)
        try:
            with request_deadline(1.5):
                started = time.monotonic()
                with pytest.raises(BackendUnavailableError, match=re.escape(f"Milvus at {uri}")):
                    server.has_collection("gallery")
                with pytest.raises(BackendUnavailableError, match=re.escape("deadline of 1.5 s")):
                    server.has_collection("gallery")  # nothing left for a second call
                took = time.monotonic() - started
        finally:
            server.close()
    assert took < 1.5 + 0.5, f"took {took:.2f} s"
