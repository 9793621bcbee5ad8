"""Shared fixtures: an exported pretrained model, generated galleries, a built index."""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from threadpoolctl import threadpool_limits

from bench.lib.images import export_small_model, make_image
from tests import tiers
from tests.support.milvus_server import MilvusServerProcess, running_milvus_server
from tests.tiers import starts

# Set before pymilvus loads gRPC: its fork handlers restart pollers in a forked child, which can then abort
# before exec (grpc/grpc#43055); the tests fork server processes after Milvus Lite tests ran.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Each test process computes on one thread (torch, scikit-learn's OpenMP, FAISS, the BLAS): on a machine
# whose cores are all busy, idle OpenMP threads spin for work and burn the CPU time the computing thread
# needs (a t-SNE of 111 points took 28 s of CPU with 2 threads under load, 1 s with one). Set before those
# libraries load (the imports above load none of them); an explicit value in the environment wins.
for _threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")


def pytest_configure(config: pytest.Config) -> None:
    # The fast tier (`make test`) and the slow one: the markers, the marking of tests from the fixtures they
    # use, and the guard that fails a fast-tier test which starts a server, a cluster, a browser or a
    # container (tests/tiers.py).
    config.pluginmanager.register(tiers, "dmlsearch-tiers")
    # numpy's BLAS loaded with pytest's plugins, before the setting above: limited where it already runs.
    threadpool_limits(limits=int(os.environ["OPENBLAS_NUM_THREADS"]), user_api="blas")


# pytorch-metric-learning's k-NN imports this module, which replaces faiss's functions and index methods
# (search, add, knn, ...) in the whole process with torch versions that refuse ``params``, as Milvus Lite
# passes them: a later test in the same process would then fail for a reason of its own test order.
FAISS_TORCH_PATCH = "faiss.contrib.torch_utils"


@pytest.fixture(autouse=True)
def faiss_as_installed() -> Iterator[None]:
    """faiss as it is installed after every test: a test that loaded :data:`FAISS_TORCH_PATCH` (directly, or
    through pytorch-metric-learning) has it undone, from the originals the patch keeps as ``NAME_numpy``."""
    yield
    if sys.modules.pop(FAISS_TORCH_PATCH, None) is None:
        return
    import faiss

    for owner in (faiss, *(value for value in vars(faiss).values() if isinstance(value, type))):
        for name, original in list(vars(owner).items()):
            if name.endswith("_numpy"):
                setattr(owner, name.removesuffix("_numpy"), original)
                delattr(owner, name)


@pytest.fixture
def faiss_with_torch() -> None:
    """faiss patched to take torch tensors for this test (what pytorch-metric-learning's k-NN expects), even
    after an earlier test's patch was undone: the import runs the patch again."""
    importlib.import_module(FAISS_TORCH_PATCH)


# How often pymilvus's client asks whether the server is done with a new collection's index, a load or a
# flush: every 20 ms in the tests instead of every 0.2-0.5 s (it sleeps 0.5 s even before its first ask, and
# each Milvus index makes three collections, whose indexes Milvus Lite builds at once). Its longer waits (3 s
# before reconnecting an idle channel, 5 s between flush-all polls) stay as they are.
MILVUS_POLL_S = 0.02
MILVUS_POLLS_UP_TO_S = 0.5


class _QuickMilvusPolls:
    """The ``time`` module as pymilvus's gRPC handler sees it: its polls of a server's state sleep
    :data:`MILVUS_POLL_S`; everything else is the real module."""

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(MILVUS_POLL_S if seconds <= MILVUS_POLLS_UP_TO_S else seconds)


@pytest.fixture(autouse=True)
def milvus_polls_quickly(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fast-tier test polls Milvus every :data:`MILVUS_POLL_S`: the same requests, answered the same way,
    without ~1.5 s of sleep per index made. The slow tier's tests against the real server (outages,
    restarts) keep pymilvus's own pace, as does a CLI run in a subprocess."""
    if tiers.in_slow_tier(request.node):
        yield
        return
    try:
        from pymilvus.client import grpc_handler  # loaded anyway by collecting tests/index
    except ImportError:  # the milvus extra is not installed: its tests skip
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpc_handler, "time", _QuickMilvusPolls())
        yield


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """A folder ``make(folder)`` fills once per test run: under pytest-xdist the first worker to ask makes it
    while the others wait, then all read it (a session fixture is otherwise made in every worker: an ONNX
    export, an index build). Read-only, as a session fixture's files are anyway."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / f"made-once-{name}"
    with open(root / f"made-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"made-once-{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (root / f"made-once-{name}.done").touch()
    return folder


@pytest.fixture(scope="session")
def exported_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained EfficientNet-Lite0 embedder exported to ONNX (model.onnx + model.json)."""
    from training.backbone import BACKBONES, create_backbone
    from training.export import export_onnx
    from training.model import EmbeddingModel

    def export(folder: Path) -> None:
        export_onnx(
            EmbeddingModel(create_backbone("efficientnet_lite0")),
            folder / "model.onnx",
            preprocessing=BACKBONES["efficientnet_lite0"].preprocessing,
            backbone="efficientnet_lite0",
        )

    return made_once(tmp_path_factory, "model", export) / "model.onnx"


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model than ``exported_model`` (a small 24-d CNN): what indexes are rebuilt or reloaded with."""

    def export(folder: Path) -> None:
        export_small_model(folder / "small.onnx", seed=7)

    return made_once(tmp_path_factory, "small_model", export) / "small.onnx"


@pytest.fixture(scope="session")
def demo_gallery(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.gallery.demo import write_demo_gallery

    return made_once(tmp_path_factory, "demo_gallery", write_demo_gallery)


@pytest.fixture(scope="session")
def demo_index(tmp_path_factory: pytest.TempPathFactory, exported_model: Path, demo_gallery: Path) -> Path:
    from engine.build.indexing import build_index
    from engine.model.embedder import Embedder

    def build(folder: Path) -> None:
        build_index(demo_gallery, Embedder(exported_model), folder / "index", progress=False)

    return made_once(tmp_path_factory, "demo_index", build) / "index"


@pytest.fixture
def synthetic_gallery(tmp_path: Path) -> Path:
    """Three labelled folders of generated images, plus one corrupt and one non-image file."""
    root = tmp_path / "gallery"
    for label_index, label in enumerate(["alpha", "beta", "gamma"]):
        folder = root / label
        folder.mkdir(parents=True)
        for i in range(3):
            make_image(100 * label_index + i).save(folder / f"{label}_{i}.png")
    (root / "beta" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    (root / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="session")
@starts("server")
def milvus_server() -> Iterator[MilvusServerProcess]:
    """The real Milvus standalone server (``milvus`` package), started once per session in a temporary data
    folder on a free port; stopped (its process group killed if need be) and its folder removed at the end.
    Tests that need it skip, saying why, only where it cannot start on this machine."""
    with running_milvus_server("dmlsearch-milvus-") as server:
        yield server
