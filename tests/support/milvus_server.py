"""The real Milvus standalone server's lifecycle (start, readiness, stop of its process group), and the Milvus
engines the backend suites run on."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.lib.cluster import group_alive, group_members
from bench.lib.servers import free_port
from index.connection import MilvusConnection

# Seconds the real Milvus server gets to start (it unpacks 250 MB of binaries into its data folder first;
# about 15-20 s here) and to stop on SIGTERM before the whole process group is killed.
MILVUS_START_TIMEOUT_S = 180
MILVUS_STOP_GRACE_S = 10
MILVUS_SERVER_IDS = Path("/tmp/milvus")
MILVUS_FIRST_LOGIN = "root:Milvus"  # the user Milvus makes when logins are enabled, and its password
# Starts after which the server is reported unavailable: a port probed free can be taken before the server
# binds it (Ray's workers take ports in 10002-19999, the range of its coordinators' default ports).
MILVUS_START_ATTEMPTS = 3
# ``milvus-server`` with one change: it probes its ports as the server binds them: on every address (it
# probes 127.0.0.1 only, and a port another process listens on at the machine's own address then crashes the
# server) and with SO_REUSEADDR, so a restart takes its port back while the connections of the stopped server
# linger in TIME_WAIT (it would move to the next free port otherwise).
MILVUS_LAUNCHER = """
import socket, sys, milvus

def try_bind_port(self, port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("", port))
        sock.listen()
        return sock
    except OSError:
        sock.close()
        return None

milvus.MilvusServerConfig.try_bind_port = try_bind_port
sys.argv[0] = "milvus-server"
sys.exit(milvus.main())
"""


class MilvusServerUnavailable(RuntimeError):
    """The real Milvus server cannot start on this machine (not installed, or it exited or never answered)."""


@dataclass
class MilvusServerProcess:
    """The real Milvus standalone server of the ``milvus`` package (``milvus-server``) as a process group,
    on ``port`` with its data in ``data``; :meth:`stop` then :meth:`start` again keeps its data.

    ``auth``: logins required (``common.security.authorizationEnabled``; its first user is ``root`` with
    the password ``Milvus``, and :attr:`token` is what this helper logs in with); ``tls``: the certificate
    and key files it serves TLS with (``common.security.tlsMode`` 1), checked against ``ca`` here."""

    data: Path
    port: int
    process: subprocess.Popen | None = None
    auth: bool = False
    tls: tuple[Path, Path] | None = None
    ca: Path | None = None
    token: str = MILVUS_FIRST_LOGIN

    @property
    def uri(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def client(self, timeout: float = 10) -> Any:
        """A pymilvus client of this server, logged in as :attr:`token` where it takes logins."""
        from pymilvus import MilvusClient

        options: dict[str, object] = {"token": self.token} if self.auth else {}
        if self.ca is not None:
            options["server_pem_path"] = str(self.ca)
        return MilvusClient(self.uri, timeout=timeout, **options)

    def server_options(self) -> list[str]:
        """``milvus-server`` flags for :attr:`auth` and :attr:`tls` (its template's ``authorization_enabled``
        and ``tls_mode``, ``server_pem_path`` and ``server_key_path``)."""
        options = ["--authorization-enabled", "true"] if self.auth else []
        if self.tls is not None:
            cert, key = self.tls
            options += ["--tls-mode", "1", "--server-pem-path", str(cert), "--server-key-path", str(key)]
        return options

    @property
    def log(self) -> Path:
        return self.data / "logs" / "milvus-server.log"

    def start(self) -> None:
        if importlib.util.find_spec("milvus") is None:
            raise MilvusServerUnavailable(
                "the milvus package is not installed (pip install 'dmlsearch[milvus-server]')"
            )
        self.log.parent.mkdir(parents=True, exist_ok=True)
        etcd_config = self.data / "etcd.yaml"
        if not etcd_config.exists():  # kept across restarts: the etcd data records its addresses
            # Its embedded etcd listens on 2379 and 2380 unless told otherwise: ports of its own, so that
            # it starts beside another Milvus or etcd.
            etcd_port, peer_port = free_port(), free_port()
            etcd_config.write_text(
                f"listen-client-urls: http://localhost:{etcd_port}\n"
                f"advertise-client-urls: http://localhost:{etcd_port}\n"
                f"listen-peer-urls: http://localhost:{peer_port}\n"
                f"initial-advertise-peer-urls: http://localhost:{peer_port}\n"
                f"initial-cluster: default=http://localhost:{peer_port}\n"
            )
        etcd_port = etcd_config.read_text().split("localhost:")[1].split()[0]
        command = [
            *("--data", str(self.data), "--proxy-port", str(self.port), "--etcd-port", etcd_port),
            *self.server_options(),
        ]
        for _ in range(MILVUS_START_ATTEMPTS):
            # Both rewritten by this start: a stale one would mislead _wait_until_serving.
            (self.data / "configs" / "milvus.yaml").unlink(missing_ok=True)
            self.stderr_log.unlink(missing_ok=True)
            with self.log.open("ab") as output:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", MILVUS_LAUNCHER, *command],
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "ETCD_CONFIG_PATH": str(etcd_config)},  # read as etcd.config.path
                    start_new_session=True,  # its own process group: stop() reaches the server it spawns
                )
            try:
                self._wait_until_serving()
                return
            except MilvusServerUnavailable as err:
                self.stop()
                failure = err
        raise MilvusServerUnavailable(f"{MILVUS_START_ATTEMPTS} starts failed; the last: {failure}")

    def _wait_until_serving(self) -> None:
        from pymilvus import MilvusException

        deadline = time.monotonic() + MILVUS_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise MilvusServerUnavailable(
                    f"milvus-server exited with code {self.process.returncode}: {self._log_tail()}"
                )
            # The server's binary panics (a port taken since it was probed) without its launcher exiting.
            panic = self._panic()
            if panic:
                raise MilvusServerUnavailable(f"milvus-server crashed: {panic}")
            # milvus-server moves to the next free port when the one asked for is taken: check its config.
            config = self.data / "configs" / "milvus.yaml"
            if config.exists() and f"port: {self.port}\n" not in config.read_text():
                raise MilvusServerUnavailable(f"port {self.port} was taken before milvus-server bound it")
            try:
                self.client(timeout=2).get_server_version()
                return
            except MilvusException:
                pass
            if time.monotonic() > deadline:
                raise MilvusServerUnavailable(
                    f"milvus-server did not answer within {MILVUS_START_TIMEOUT_S} s: {self._log_tail()}"
                )
            time.sleep(0.5)

    @property
    def stderr_log(self) -> Path:
        return self.data / "logs" / "milvus-stderr.log"

    def _panic(self) -> str | None:
        """The message of a Go panic in the server's stderr (``panic: …``), if any."""
        if not self.stderr_log.exists():
            return None
        lines = self.stderr_log.read_text(errors="replace").splitlines()
        return next((line for line in lines if line.startswith(("panic: ", "fatal error: "))), None)

    def _log_tail(self) -> str:
        logs = [self.log, self.stderr_log]
        return " | ".join(log.read_text(errors="replace")[-1000:] for log in logs if log.exists())

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL once the grace period is over (milvus-server may
        ignore SIGTERM); returns when no process of the group is left."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the group's id is the leader's pid
        members = group_members(group)
        for sig, grace in ((signal.SIGTERM, MILVUS_STOP_GRACE_S), (signal.SIGKILL, MILVUS_STOP_GRACE_S)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
            deadline = time.monotonic() + grace
            while group_alive(group, self.process) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not group_alive(group, self.process):
                break
        self.process = None
        # Milvus 2.3 leaves /tmp/milvus/server_id_PID behind, outside its data folder.
        for pid in members:
            (MILVUS_SERVER_IDS / f"server_id_{pid}").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            MILVUS_SERVER_IDS.rmdir()  # only when empty: another Milvus may be running


# The Milvus engines the backend suites run on besides FAISS: Milvus Lite in-process, the real server.
MILVUS_BACKENDS = ("milvus-lite", "milvus-server")
# The same as test parameters: the real server's puts its tests in the slow tier (tests/tiers.py).
MILVUS_PARAMS = ("milvus-lite", pytest.param("milvus-server", marks=pytest.mark.server))


def milvus_target(backend: str, request: pytest.FixtureRequest, directory: Path) -> dict[str, object]:
    """``GalleryIndex.create`` arguments for a fresh collection on ``backend`` (one of
    :data:`MILVUS_BACKENDS`); the real server's collection is dropped when the test (or module) ends."""
    pytest.importorskip("pymilvus")
    if backend == "milvus-lite":
        pytest.importorskip("milvus_lite")
        return {"backend": "milvus"}
    server: MilvusServerProcess = request.getfixturevalue("milvus_server")
    collection = f"test_{os.urandom(6).hex()}"

    def drop() -> None:
        from pymilvus import MilvusClient

        if server.process is not None:
            client = MilvusClient(server.uri, timeout=10)
            client.drop_collection(collection)
            client.close()

    request.addfinalizer(drop)
    return {"backend": "milvus", "milvus": MilvusConnection(server.uri, collection)}


@contextmanager
def running_milvus_server(prefix: str, **options: Any) -> Iterator[MilvusServerProcess]:
    """A real Milvus server in a temporary data folder on a free port, stopped (its process group killed if
    need be) and its folder removed at the end; the test skips, saying why, only where it cannot start.
    ``options``: :class:`MilvusServerProcess`'s ``auth``, ``tls`` and ``ca``."""
    pytest.importorskip("pymilvus")
    server = MilvusServerProcess(Path(tempfile.mkdtemp(prefix=prefix)), free_port(), **options)
    try:
        server.start()
    except MilvusServerUnavailable as err:
        shutil.rmtree(server.data, ignore_errors=True)
        pytest.skip(f"the real Milvus server cannot start here: {err}")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.data, ignore_errors=True)
