"""build-index on a real local Ray cluster (a head and a second node, separate ``ray start`` processes):
the same index as a local build, reruns, a stop signal, and the faults of a worker and of a node."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.lib.cluster import RayCluster
from bench.lib.images import make_image, write_labelled_folder
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.manifest import MANIFEST_NAME, Manifest
from index.staging import staging_directory
from tests.support.images import copy_with_truncated_jpeg
from tests.support.ray_cluster import running_ray_cluster
from tests.support.waiting import wait_until
from tests.tiers import starts

# The embedding actors' process title (Ray Data's map worker running engine.build.ray_runner.EmbedActor).
ACTOR_TITLE = "MapBatches(EmbedActor)"
BUILD_TIMEOUT_S = 300
# What build-index prints with --no-progress (its summary, and the files it skipped), and the only notices
# of Ray's it lets through (README, "More than one machine").
BUILD_LINES = ("indexed ", "faiss index ", "milvus index ", "skipped ", "  ")
RAY_NOTICES = (
    "has constructor arguments in the object store",
    "(raylet) The node with node id:",  # "... has been marked dead because the detector has missed ..."
    "(raylet) Raylet is terminated. Termination is unexpected.",
)

# Every test runs Ray: a local cluster in the CLI's process, or the module's cluster. Ray is looked for, not
# imported: collecting this module for the fast tier (which leaves it out) does not load Ray.
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'dmlsearch[ray]')"
    ),
]


@pytest.fixture(scope="module")
@starts("cluster")
def ray_cluster() -> Iterator[RayCluster]:
    with running_ray_cluster(cpus_per_node=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.lib.images import export_small_model

    return export_small_model(tmp_path_factory.mktemp("ray-model") / "model.onnx", seed=7)


def _gallery(root: Path) -> Path:
    """Labelled images, a truncated JPEG (unreadable), a copy of an image (a duplicate), one without label."""
    write_labelled_folder(root / "plain", classes=4, per_class=5, size=48)
    gallery = root / "gallery"
    copy_with_truncated_jpeg(root / "plain", gallery)
    shutil.copy(gallery / "class_00" / "img_0.png", gallery / "class_02" / "copy.png")
    make_image(5).save(gallery / "unlabelled.png")
    return gallery


def _big_gallery(root: Path, count: int) -> Path:
    for i in range(count):
        folder = root / f"class_{i % 5}"
        folder.mkdir(parents=True, exist_ok=True)
        make_image(i, (40, 40)).save(folder / f"img_{i:04d}.png")
    return root


def _build_command(gallery: Path, model: Path, out: Path, *options: str) -> list[str]:
    """The ``dmlsearch build-index`` command line, run by the tests' own interpreter (no PATH needed)."""
    command = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--out", str(out)]
    return [*command, "--model", str(model), *options, "--no-progress"]


def _plain(output: str) -> str:
    """``output`` without terminal colour codes (Ray colours its "(raylet)" prefix)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", output)


def _cli_build(
    cluster: RayCluster, gallery: Path, model: Path, out: Path, *options: str, ray: bool = True
) -> subprocess.CompletedProcess[str]:
    """build-index in a process of its own (Ray reads its settings from the environment it starts in)."""
    command = _build_command(gallery, model, out, *options, *(["--ray", cluster.address] if ray else []))
    done = subprocess.run(command, env=cluster.env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _report(done: subprocess.CompletedProcess[str], out: Path) -> tuple[list[str], list[str]]:
    """What build-index said it did into ``out`` (its summary lines) and which files it skipped, and why."""
    stdout = done.stdout.replace(str(out), "OUT")
    summary = [line for line in stdout.splitlines() if not line.startswith(("faiss index", "milvus index"))]
    skipped = [line for line in done.stderr.splitlines() if line.startswith("  ")]
    return summary, skipped


def _contents(index_dir: Path) -> dict[str, tuple[str | None, str, np.ndarray]]:
    """path -> (label, content hash, vector) of every item."""
    index = GalleryIndex.open(index_dir)
    try:
        items = list(index.items.scan())
        vectors = index.vectors([item.id for item in items])
        return {
            item.path: (item.label, item.content_hash, vector)
            for item, vector in zip(items, vectors, strict=True)
        }
    finally:
        index.close()


@pytest.mark.parametrize("backend", ["faiss", "milvus"])
def test_a_ray_build_writes_the_index_a_local_build_writes(
    ray_cluster: RayCluster, model: Path, tmp_path: Path, backend: str
) -> None:
    if backend == "milvus":  # Milvus Lite, in the index directory
        pytest.importorskip("milvus_lite")
    gallery = _gallery(tmp_path)
    local_out, ray_out = tmp_path / "local", tmp_path / "ray"
    options = ("--backend", backend)
    local = _report(_cli_build(ray_cluster, gallery, model, local_out, *options, ray=False), local_out)
    remote = _report(_cli_build(ray_cluster, gallery, model, ray_out, *options), ray_out)

    assert remote == local
    summary, skipped = remote
    assert summary[0].startswith("indexed 21 images")  # 20 labelled + 1 unlabelled; the copy is a duplicate
    assert any("class_02/copy.png" in line for line in summary)  # listed as a copy, not embedded
    assert [line.split(":")[0] for line in skipped] == ["  class_01/broken.jpg"]
    expected, got = _contents(local_out), _contents(ray_out)
    assert sorted(got) == sorted(expected)
    for path, (label, content_hash, vector) in expected.items():
        assert got[path][:2] == (label, content_hash)
        np.testing.assert_allclose(got[path][2], vector, atol=1e-5)
    assert got["unlabelled.png"][0] is None and got["class_03/img_1.png"][0] == "class_03"


def test_a_local_ray_build_shows_the_builds_output_without_rays_notices(model: Path, tmp_path: Path) -> None:
    """``--ray local``: Ray's INFO lines, its notice that its progress bars are off (the build shows its
    own) and its notice that the runtime it starts has token authentication stay out of the output."""
    gallery = write_labelled_folder(tmp_path / "gallery", classes=2, per_class=3, size=40)
    command = _build_command(gallery, model, tmp_path / "index", "--ray", "local")
    environment = {
        name: value for name, value in os.environ.items() if not name.startswith(("RAY_AUTH", "RAY_ADDRESS"))
    }
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "indexed 6 images" in done.stdout
    output = done.stdout + done.stderr
    for notice in (" INFO ", "Progress bars disabled", "Token authentication is enabled"):
        assert notice not in output, output


@pytest.mark.parametrize("listening", [False, True], ids=["closed port", "not a Ray head"])
def test_an_address_where_no_ray_head_answers_is_a_clear_error_within_seconds(
    model: Path, tmp_path: Path, listening: bool
) -> None:
    """Before: ray.init retried for many minutes, printing only Ray's own warnings."""
    gallery = write_labelled_folder(tmp_path / "gallery", classes=2, per_class=2, size=40)
    with socket.socket() as server:  # bound only: refuses connections; listening: accepts, speaks no gRPC
        server.bind(("127.0.0.1", 0))
        if listening:
            server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        command = _build_command(gallery, model, tmp_path / "index", "--ray", address)
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: no Ray cluster answers at {address}" in done.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "index").exists()


@pytest.mark.parametrize(
    ("token", "said"),
    [
        (None, "sent none, as RAY_AUTH_MODE=token is not set here"),
        ("not-the-heads", "sent a token it refused"),
    ],
    ids=["no token", "a wrong token"],
)
def test_a_cluster_that_requires_a_token_refuses_a_build_without_it_saying_token_and_where_it_goes(
    ray_cluster: RayCluster, model: Path, tmp_path: Path, token: str | None, said: str
) -> None:
    """Before: ray.init failed after about 20 s with Ray's "Failed to connect to GCS", naming no token."""
    gallery = write_labelled_folder(tmp_path / "gallery", classes=2, per_class=2, size=40)
    environment = {name: value for name, value in ray_cluster.env.items() if not name.startswith("RAY_AUTH")}
    if token is not None:
        environment |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    command = _build_command(gallery, model, tmp_path / "index", "--ray", ray_cluster.address)
    started = time.monotonic()
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the Ray cluster at {ray_cluster.address} requires an authentication token" in done.stderr
    assert said in done.stderr
    for where in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"):
        assert where in done.stderr
    assert "Failed to connect" not in done.stderr
    # No bound on the time: it is the CLI's own start (a minute on a loaded 2-core machine), one request.
    print(f"refused in {took:.1f} s")
    assert not (tmp_path / "index").exists()


def test_a_rerun_embeds_only_new_and_changed_files(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
) -> None:
    gallery = _gallery(tmp_path)
    out = tmp_path / "ray"
    _cli_build(ray_cluster, gallery, model, out)
    make_image(900).save(gallery / "class_03" / "new.png")
    make_image(901).save(gallery / "class_00" / "img_1.png")  # changed content

    summary, _ = _report(_cli_build(ray_cluster, gallery, model, out), out)

    assert summary[0] == "indexed 2 images into OUT (20 unchanged, 0 moved, 1 removed)"
    assert Manifest.load(out).count == 22


def _count(out: Path) -> int:
    """Items written so far: in the staging copy while the build runs (the index appears complete)."""
    directory = staging_directory(out) if staging_directory(out).exists() else out
    if not (directory / MANIFEST_NAME).exists():
        return 0
    store = ItemStore(directory, Manifest.load(directory).dim, read_only=True)
    try:
        return len(store)
    finally:
        store.close()


def _start_cli_build(cluster: RayCluster, gallery: Path, model: Path, out: Path) -> subprocess.Popen:
    command = _build_command(gallery, model, out, "--ray", cluster.address, "--batch-size", "4")
    return subprocess.Popen(
        command, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _actors(cluster: RayCluster, nodes: range) -> list[tuple[int, int]]:
    """(node, pid) of the embedding actors on ``nodes``."""
    return [(node, pid) for node in nodes for pid, cmd in cluster.node_processes(node) if ACTOR_TITLE in cmd]


def _check_one_item_per_file(out: Path, files: int) -> None:
    contents = _contents(out)
    assert len(contents) == files == Manifest.load(out).count
    assert len({content_hash for _, content_hash, _ in contents.values()}) == files


def test_a_worker_process_killed_mid_build_is_retried_and_every_file_indexed_once(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
) -> None:
    gallery = _big_gallery(tmp_path / "gallery", 400)
    out = tmp_path / "index"
    build = _start_cli_build(ray_cluster, gallery, model, out)
    try:
        wait_until(lambda: _count(out) > 0 or build.poll() is not None, BUILD_TIMEOUT_S, "the first batch")
        actors = _actors(ray_cluster, range(len(ray_cluster.nodes)))
        assert actors and build.poll() is None and _count(out) < 400, "the build ended before the kill"
        os.kill(actors[0][1], signal.SIGKILL)
        output, _ = build.communicate(timeout=BUILD_TIMEOUT_S)
    finally:
        build.kill()
    assert build.returncode == 0, output
    _check_one_item_per_file(out, 400)


def test_a_stopped_build_resumes_where_it_stopped(
    ray_cluster: RayCluster, model: Path, tmp_path: Path
) -> None:
    gallery = _big_gallery(tmp_path / "gallery", 400)
    out = tmp_path / "index"
    build = _start_cli_build(ray_cluster, gallery, model, out)
    try:
        wait_until(lambda: _count(out) > 0 or build.poll() is not None, BUILD_TIMEOUT_S, "the first batch")
        assert build.poll() is None, "the build ended before the stop"
        build.send_signal(signal.SIGTERM)
        output, _ = build.communicate(timeout=BUILD_TIMEOUT_S)
    finally:
        build.kill()
    assert build.returncode == 128 + signal.SIGTERM, output
    done = _count(out)
    assert 0 < done < 400

    rerun = _start_cli_build(ray_cluster, gallery, model, out)
    output, _ = rerun.communicate(timeout=BUILD_TIMEOUT_S)
    assert rerun.returncode == 0, output
    assert f"indexed {400 - done} images" in output
    _check_one_item_per_file(out, 400)


@pytest.mark.parametrize("lost", ["node", "raylet"])
def test_a_node_removed_mid_build_leaves_the_build_to_the_nodes_left(
    ray_cluster: RayCluster, model: Path, tmp_path: Path, lost: str
) -> None:
    """``node``: every process of the worker node SIGKILLed at once; ``raylet``: its raylet alone (before:
    Ray printed the raylet's last log lines and state dump, twice, 49 lines)."""
    # More files than the other faults: the pool starts with one actor and adds the worker node's when
    # there is work left for it, which must still be the case when that node is removed.
    gallery = _big_gallery(tmp_path / "gallery", 1000)
    out = tmp_path / "index"
    build = _start_cli_build(ray_cluster, gallery, model, out)
    try:
        worker_nodes = range(1, len(ray_cluster.nodes))
        wait_until(
            lambda: _actors(ray_cluster, worker_nodes) or build.poll() is not None,
            BUILD_TIMEOUT_S,
            "an embedding actor on the worker node",
        )
        assert build.poll() is None and _count(out) < 1000, "the build ended before the node was removed"
        if lost == "node":
            ray_cluster.remove_worker()
        else:
            node = len(ray_cluster.nodes) - 1
            raylets = [pid for pid, command in ray_cluster.node_processes(node) if "/raylet " in command]
            assert raylets, ray_cluster.node_processes(node)
            os.kill(raylets[0], signal.SIGKILL)
        started = time.monotonic()
        output, _ = build.communicate(timeout=BUILD_TIMEOUT_S)
    finally:
        build.kill()
        if lost == "raylet":
            ray_cluster.remove_worker()  # what is left of the node
        if len(ray_cluster.nodes) < 2:
            ray_cluster.add_worker()
    assert build.returncode == 0, f"{output} (after {time.monotonic() - started:.0f} s)"
    _check_one_item_per_file(out, 1000)
    # What the README says a build prints besides its own lines: Ray's notice about the actors' constructor
    # arguments, and, for the node lost, one line for each of Ray's notices about it.
    ray_lines = [line for line in _plain(output).splitlines() if not line.startswith(BUILD_LINES)]
    assert len(ray_lines) <= 3, output
    for line in ray_lines:
        assert any(notice in line for notice in RAY_NOTICES), output
