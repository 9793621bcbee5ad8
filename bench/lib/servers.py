"""A real ``dmlsearch serve`` process on a free port, started and waited for until it is ready."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


class ServerNotReady(RuntimeError):
    """A started server exited, or never answered 200 on its readiness path in time."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice; another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: Path | None  # its stdout and stderr (uvicorn's access log among them), when asked for

    def status(self, field: str) -> int:
        """A ``/proc/PID/status`` figure in bytes (``VmRSS``, ``VmHWM``, ``VmSize``)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)


def reset_peak(server: ServerProcess) -> int:
    """Reset the server's peak RSS (``VmHWM``) to its current RSS, and return that."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    return server.status("VmRSS")


def start_server(
    args: list[str],
    env: dict[str, str] | None = None,
    *,
    address_space: int | None = None,
    log: Path | None = None,
    prefix: list[str] | None = None,
) -> ServerProcess:
    """``dmlsearch serve ARGS`` in a real uvicorn process on a free port, one onnxruntime thread unless ARGS
    say otherwise (the last ``--threads`` counts).

    ``address_space``: an ``RLIMIT_AS`` cap in bytes, what ``prlimit --as`` sets; ``log``: a file its output
    is appended to (``os.devnull`` to drop it); ``prefix``: a command the server runs under (``unshare ...``).
    """
    port = free_port()
    command = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--threads", "1", *args]

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    output = log.open("ab") if log is not None else None
    process = subprocess.Popen(
        [*(prefix or []), *command],
        env={**os.environ, **(env or {})},
        # Only when needed: a preexec_fn makes Python fork() instead of vfork(), and a fork while Milvus
        # Lite's gRPC threads run can abort the child (grpc/grpc#43055, seen here as exit code -6).
        preexec_fn=cap if address_space is not None else None,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
    )
    if output is not None:
        output.close()
    return ServerProcess(f"http://127.0.0.1:{port}", process, log)


def wait_ready(server: ServerProcess, ready_path: str = "/readyz", timeout: float = 90) -> None:
    """Return once ``ready_path`` answers 200; raise :class:`ServerNotReady` if the server exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    answer = "no answer"
    while True:
        if server.process.poll() is not None:
            raise ServerNotReady(f"server exited with code {server.process.returncode}")
        try:
            response = httpx.get(f"{server.url}{ready_path}", timeout=2)
            if response.status_code == 200:
                return
            answer = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"{server.url}{ready_path} never answered 200 ({answer})")
        time.sleep(0.2)


@contextmanager
def serving(
    args: list[str],
    env: dict[str, str] | None = None,
    ready_path: str = "/readyz",
    *,
    address_space: int | None = None,
    log: Path | None = None,
    prefix: list[str] | None = None,
    timeout: float = 90,
) -> Iterator[ServerProcess]:
    """A started server (:func:`start_server`) once ``ready_path`` answers 200; stopped afterwards."""
    server = start_server(args, env, address_space=address_space, log=log, prefix=prefix)
    try:
        wait_ready(server, ready_path, timeout)
        yield server
    finally:
        if server.process.poll() is None:
            server.process.terminate()
            server.process.wait(timeout=20)
