"""Helpers shared by the tests: generated images, labelled folders, clustered vectors, served index copies and
real uvicorn servers. Fixtures live in the conftests; everything a test imports lives here."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest
from PIL import Image, ImageOps

from engine.model.model_card import ModelCard
from index.connection import MilvusConnection
from index.manifest import Manifest
from index.protocol import Entry

if TYPE_CHECKING:
    from training.config import TrainConfig

API_KEY = "test-key-0123456789"
# Ray's command beside the tests' interpreter: `make test` runs without the venv on PATH.
RAY_COMMAND = str(Path(sys.executable).with_name("ray"))
BENCH = Path(__file__).resolve().parents[1] / "bench"
INDEX_FILES = ("manifest.json", "vectors.faiss", "items.sqlite")


def make_image(seed: int, size: tuple[int, int] = (96, 80), mode: str = "RGB") -> Image.Image:
    """A deterministic synthetic photo-like image: smooth colour gradients plus seeded blobs."""
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = []
    for _ in range(3):
        a, b, c = rng.uniform(-3, 3, size=3)
        channels.append(np.sin(a * x * 6 + b * y * 6 + c))
    array = (np.stack(channels, axis=-1) * 0.5 + 0.5) * 255
    return Image.fromarray(array.astype(np.uint8), "RGB").convert(mode)


def image_bytes(image: Image.Image, fmt: str = "PNG", **save_args: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_labelled_folder(root: Path, classes: int = 12, per_class: int = 5, size: int = 64) -> Path:
    """``root/class_XX/img_Y.png``: each class is one generated picture; its images are crops/tints of it."""
    for label in range(classes):
        base = make_image(1000 + label, (size + 16, size + 16))
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True)
        rng = np.random.default_rng(label)
        for i in range(per_class):
            left, top = rng.integers(0, 16, size=2)
            image = base.crop((left, top, left + size, top + size))
            if i % 2:
                image = ImageOps.mirror(image)
            tint = Image.new("RGB", image.size, tuple(int(v) for v in rng.integers(0, 255, size=3)))
            Image.blend(image, tint, 0.15).save(folder / f"img_{i}.png")
    return root


def copy_with_truncated_jpeg(folder: Path, target: Path) -> Path:
    """A copy of the labelled ``folder`` at ``target`` plus ``class_01/broken.jpg``, a JPEG cut short like
    Cars196's train_08144.jpg; returns the broken file."""
    shutil.copytree(folder, target)
    broken = target / "class_01" / "broken.jpg"
    Image.open(target / "class_01" / "img_0.png").convert("RGB").save(broken, quality=90)
    broken.write_bytes(broken.read_bytes()[:-400])
    return broken


def export_small_model(path: Path, *, seed: int, dim: int = 24, reranker: object = None) -> Path:
    """A small seeded CNN embedder exported like any model (model.onnx + model.json): a "new model" for
    rebuild and reload tests that embeds fast and differs from the pretrained one (fingerprint, dimension)."""
    import torch
    from torch import nn

    from engine.model.model_card import Preprocessing
    from training.export import export_onnx
    from training.model import EmbeddingModel

    torch.manual_seed(seed)
    network = nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=4, stride=4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, dim),
    )
    export_onnx(
        EmbeddingModel(network),
        path,
        preprocessing=Preprocessing(input_size=32, resize_size=32),
        backbone=f"small-cnn-seed{seed}",
        reranker=reranker,
    )
    return path


def bench_module(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A bench script as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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


def start_server(
    args: list[str],
    env: dict[str, str] | None = None,
    *,
    address_space: int | None = None,
    log: Path | None = None,
    prefix: list[str] | None = None,
) -> ServerProcess:
    """``dmlsearch serve ARGS`` in a real uvicorn process on a free port (see :func:`uvicorn_server`).

    ``address_space``: an ``RLIMIT_AS`` cap in bytes, what ``prlimit --as`` sets; ``prefix``: a command
    the server runs under (``unshare ...``).
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


def wait_for(server: ServerProcess, ready_path: str = "/readyz", timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.process.poll() is None, f"server exited with code {server.process.returncode}"
        try:
            if httpx.get(f"{server.url}{ready_path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{server.url}{ready_path} never answered 200"
        time.sleep(0.2)


@contextmanager
def serving(
    args: list[str], env: dict[str, str] | None = None, ready_path: str = "/readyz", **options: object
) -> Iterator[ServerProcess]:
    """A started server (:func:`start_server`) once ``ready_path`` answers 200; stopped afterwards."""
    server = start_server(args, env, **options)
    try:
        wait_for(server, ready_path)
        yield server
    finally:
        if server.process.poll() is None:
            server.process.terminate()
            server.process.wait(timeout=20)


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


def reset_peak(server: ServerProcess) -> int:
    """Reset the server's peak RSS (``VmHWM``) to its current RSS, and return that."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    return server.status("VmRSS")


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


def group_alive(group: int, leader: subprocess.Popen) -> bool:
    leader.poll()  # reap the leader, or it stays a zombie member of the group
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    # Members that exited but wait for their parent to reap them are gone for our purpose.
    return any(_state(pid) not in ("Z", None) for pid in group_members(group))


def group_members(group: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                members.append(int(stat.parent.name))
    return members


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


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


# A Ray node's start (its GCS, raylet and agents) on a loaded 2-core machine.
RAY_START_TIMEOUT_S = 120
RAY_STOP_GRACE_S = 10


class RayClusterUnavailable(RuntimeError):
    """A local Ray cluster cannot start on this machine (ray not installed, or a node never came up)."""


@dataclass
class RayCluster:
    """A real Ray cluster on this machine: a head and worker nodes started by ``ray start --block``, each
    in a process group of its own (so one node can be removed, and the stop reaches every process a node
    spawned without touching another Ray on the machine), with token authentication and temporary
    folders in ``root``.

    ``pin_cores``: run node k on core k (modulo the machine's cores, by CPU affinity, which every process
    the node starts inherits), so that a node's ``--num-cpus`` is also the compute it can use: two 1-CPU
    nodes on one machine then stand for two 1-core machines (a bench of scaling needs that; Ray's CPU count
    alone is only a scheduling label)."""

    root: Path
    cpus_per_node: int = 1
    pin_cores: bool = False
    port: int = 0
    nodes: list[subprocess.Popen] = dataclass_field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster needs: the project on its path, and the cluster's auth token
        (``ray start --head`` turns token authentication on; a client finds the token in
        ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``; Ray reads them when it is
        imported, so a client process must have them from its start)."""
        return {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.root / "auth_token"),
            "TMPDIR": str(self.root / "tmp"),  # the workers' model copies, removed with the cluster
        }

    def __post_init__(self) -> None:
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        (self.root / "auth_token").write_text(os.urandom(16).hex())

    def start(self, workers: int = 1) -> None:
        """Start the head and ``workers`` worker nodes."""
        if importlib.util.find_spec("ray") is None:
            raise RayClusterUnavailable("ray is not installed (pip install 'dmlsearch[ray]')")
        self.port = free_port()
        self._start_node(
            [
                "--head",
                "--port",
                str(self.port),
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
                "--temp-dir",
                str(self.root / "ray"),
                "--ray-client-server-port",
                str(free_port()),
            ]
        )
        for _ in range(workers):
            self.add_worker()

    def add_worker(self) -> None:
        """Join one more node (its own ``ray start --address``) and wait until the cluster counts it."""
        self._start_node(["--address", self.address])

    def remove_worker(self) -> None:
        """Kill the last worker node's processes at once (SIGKILL), as a machine that goes away."""
        node = self.nodes.pop()
        _stop_group(node, grace=0)

    def node_processes(self, node: int) -> list[tuple[int, str]]:
        """(pid, command line) of the processes of node ``node`` (0 = the head)."""
        members = []
        for pid in _tree(self.nodes[node].pid):
            with contextlib.suppress(OSError):
                members.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()))
        return members

    def _start_node(self, arguments: list[str]) -> None:
        log = (self.root / f"node{len(self.nodes)}.log").open("ab")
        pinned = (
            ["taskset", "--cpu-list", str(len(self.nodes) % (os.cpu_count() or 1))] if self.pin_cores else []
        )
        with log:
            node = subprocess.Popen(
                [
                    *pinned,
                    RAY_COMMAND,
                    "start",
                    "--block",
                    "--num-cpus",
                    str(self.cpus_per_node),
                    "--node-ip-address",
                    "127.0.0.1",
                    *arguments,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.nodes.append(node)
        self._wait_for_nodes(len(self.nodes))

    def _wait_for_nodes(self, count: int) -> None:
        probe = (
            "import ray, sys, time\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            f"deadline = time.monotonic() + {RAY_START_TIMEOUT_S}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
            "    assert time.monotonic() < deadline, 'nodes missing'\n"
            "    time.sleep(0.5)\n"
        )
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while True:
            if self.nodes[-1].poll() is not None:
                raise RayClusterUnavailable(
                    f"ray start exited with {self.nodes[-1].returncode}: {self.log_tail()}"
                )
            done = subprocess.run(
                [sys.executable, "-c", probe],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=RAY_START_TIMEOUT_S,
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RayClusterUnavailable(f"the Ray nodes did not come up: {done.stderr[-1000:]}")
            time.sleep(1)

    def log_tail(self) -> str:
        return " | ".join(
            log.read_text(errors="replace")[-800:] for log in sorted(self.root.glob("node*.log"))
        )

    def stop(self) -> None:
        """SIGTERM to each node's process group, SIGKILL after a grace period; returns when none is left."""
        while self.nodes:
            _stop_group(self.nodes.pop(), grace=RAY_STOP_GRACE_S)


def _tree(root: int) -> set[int]:
    """``root``'s process group and every descendant of its members: Ray's worker processes start sessions
    of their own, outside the group of the node that spawned them."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree = set(group_members(root)) | {root}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def _stop_group(leader: subprocess.Popen, grace: float) -> None:
    """Stop a node: its process group and its workers (``_tree``), SIGTERM then SIGKILL (at once without
    ``grace``); returns when none of them is left."""
    group = leader.pid  # start_new_session: the group's id is the leader's pid
    processes = _tree(group)
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace else (signal.SIGKILL,):
        processes |= _tree(group) if group_alive(group, leader) else set()
        for pid in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace or RAY_STOP_GRACE_S)
        while _any_alive(processes, group, leader) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _any_alive(processes, group, leader):
            return


def _any_alive(processes: set[int], group: int, leader: subprocess.Popen) -> bool:
    return group_alive(group, leader) or any(_state(pid) not in ("Z", None) for pid in processes)


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
