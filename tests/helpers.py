"""Helpers shared by the tests: generated images, labelled folders, clustered vectors, served index copies and
real uvicorn servers. Fixtures live in the conftests; everything a test imports lives here."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest
from PIL import Image

# The helpers bench/ shares with the tests (one copy for both): the tests import them from here too.
from bench.lib.cluster import RAY_COMMAND as RAY_COMMAND
from bench.lib.cluster import RayCluster as RayCluster
from bench.lib.cluster import RayClusterUnavailable as RayClusterUnavailable
from bench.lib.cluster import group_alive as group_alive
from bench.lib.cluster import group_members as group_members
from bench.lib.images import export_small_model as export_small_model
from bench.lib.images import image_bytes as image_bytes
from bench.lib.images import make_image as make_image
from bench.lib.images import write_labelled_folder as write_labelled_folder
from bench.lib.servers import ServerProcess as ServerProcess
from bench.lib.servers import free_port as free_port
from bench.lib.servers import reset_peak as reset_peak
from bench.lib.servers import serving as serving
from bench.lib.servers import start_server as start_server
from engine.model.model_card import ModelCard
from index.connection import MilvusConnection
from index.manifest import Manifest
from index.protocol import Entry

if TYPE_CHECKING:
    from training.config import TrainConfig

API_KEY = "test-key-0123456789"
INDEX_FILES = ("manifest.json", "vectors.faiss", "items.sqlite")


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.05,
    details: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` (and ``details()``, e.g. a process's log)
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what}" + (f":\n{details()}" if details else "")
            )
        time.sleep(interval)


def copy_with_truncated_jpeg(folder: Path, target: Path) -> Path:
    """A copy of the labelled ``folder`` at ``target`` plus ``class_01/broken.jpg``, a JPEG cut short like
    Cars196's train_08144.jpg; returns the broken file."""
    shutil.copytree(folder, target)
    broken = target / "class_01" / "broken.jpg"
    Image.open(target / "class_01" / "img_0.png").convert("RGB").save(broken, quality=90)
    broken.write_bytes(broken.read_bytes()[:-400])
    return broken


def clustered_vectors(
    count: int, dim: int, *, clusters: int = 30, spread: float = 0.15, seed: int = 0
) -> np.ndarray:
    """Unit vectors in tight clusters around random centres, the way image embeddings of classes sit."""
    centres = np.random.default_rng(1234).standard_normal((clusters, dim))  # the same for every seed
    rng = np.random.default_rng(seed)
    points = centres[rng.integers(clusters, size=count)] + spread * rng.standard_normal((count, dim))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    return points.astype(np.float32)


def entries(count: int, prefix: str = "img", taken: str | None = None) -> list[Entry]:
    """Entries with distinct paths and hashes (seven labels), all taken at ``taken``."""
    return [
        Entry(f"{prefix}/{i:05d}.png", f"class{i % 7}", f"{prefix}-hash-{i}", taken) for i in range(count)
    ]


@dataclass(frozen=True)
class Served:
    """A writable copy of the demo gallery, its index and its model (so tests may add, delete and tamper:
    a test that rewrote the session's exported model card changed the model every later test served)."""

    gallery: Path
    index: Path
    model: Path


def copy_served(demo_gallery: Path, demo_index: Path, exported_model: Path, target: Path) -> Served:
    gallery = target / "gallery"
    index = target / "index"
    shutil.copytree(demo_gallery, gallery)
    shutil.copytree(demo_index, index)
    manifest = Manifest.load(index)
    manifest.gallery_root = str(gallery.resolve())
    manifest.save(index)
    model = target / "model" / exported_model.name
    model.parent.mkdir()
    shutil.copy(exported_model, model)
    shutil.copy(ModelCard.path_for(exported_model), ModelCard.path_for(model))
    if (explainer := ModelCard.load(exported_model).explainer) is not None:
        shutil.copy(explainer.path_beside(exported_model), explainer.path_beside(model))
    return Served(gallery, index, model)


def index_digest(index: Path) -> dict[str, str]:
    """Content hashes of the index files, to show that a request changed nothing."""
    return {name: hashlib.sha256((index / name).read_bytes()).hexdigest() for name in INDEX_FILES}


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


def tiny_train_config(data: Path, cache: Path, **overrides: object) -> TrainConfig:
    """A training config small enough for a test: contrastive loss, a 16-d embedding and a 32-wide head on
    the cached features in ``cache``; ``overrides`` set any other field."""
    from training.config import TrainConfig  # here: the app and index tests need not load torch

    settings: dict[str, object] = {"loss": "contrastive", "embedding_dim": 16, "head_hidden": 32, **overrides}
    return TrainConfig(data=str(data), cache_dir=str(cache), **settings)


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


# Seconds the real Milvus server gets to start (it unpacks 250 MB of binaries into its data folder first;
# about 15-20 s here) and to stop on SIGTERM before the whole process group is killed.
MILVUS_START_TIMEOUT_S = 180
MILVUS_STOP_GRACE_S = 10
MILVUS_SERVER_IDS = Path("/tmp/milvus")
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
    on ``port`` with its data in ``data``; :meth:`stop` then :meth:`start` again keeps its data."""

    data: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        command = ["--data", str(self.data), "--proxy-port", str(self.port), "--etcd-port", etcd_port]
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
        from pymilvus import MilvusClient, MilvusException

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
                MilvusClient(self.uri, timeout=2).get_server_version()
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
def running_milvus_server(prefix: str) -> Iterator[MilvusServerProcess]:
    """A real Milvus server in a temporary data folder on a free port, stopped (its process group killed if
    need be) and its folder removed at the end; the test skips, saying why, only where it cannot start."""
    pytest.importorskip("pymilvus")
    server = MilvusServerProcess(Path(tempfile.mkdtemp(prefix=prefix)), free_port())
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


@contextmanager
def running_ray_cluster(cpus_per_node: int = 1) -> Iterator[RayCluster]:
    """A Ray head and one worker node on this machine, stopped and its folder removed at the end; the test
    skips, saying why, only where ray is not installed or the cluster cannot start."""
    # A short folder: Ray's socket paths must stay within the 107 bytes of a Unix socket's name.
    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="dmlray", dir="/tmp")), cpus_per_node)
    try:
        cluster.start()
    except (RayClusterUnavailable, subprocess.TimeoutExpired) as err:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
        pytest.skip(f"a local Ray cluster cannot start here: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


class CountingDecoder:
    """A ``engine.decode.pool.Decoder`` that runs its tasks here, recording the arguments of each."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, task: Callable[..., Any], *args: Any, images: int = 1, **kwargs: Any) -> Any:
        self.calls.append(args)
        return task(*args, **kwargs)
