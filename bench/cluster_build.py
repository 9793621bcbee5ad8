"""build-index on Ray against a local build, and one Ray node against two, in one run.

    python bench/cluster_build.py [--data CARS196/images] [--count 300] [--model model.onnx]
                                  [--work ~/.cache/dmlsearch/cluster_build]
                                  [--out bench/results/cluster_build]

On one gallery (the first ``--count`` images of ``--data`` in sorted order, else generated 224-px images)
and one model (``--model``, else the pretrained EfficientNet-Lite0 exported once under ``--work``), each
build into a fresh index:
- local: ``engine.build.indexing.build_index`` with its default runner (this process, decode processes);
- ray local: the same with ``engine.build.ray_runner.RayRunner()`` on a Ray runtime started in this process
  (started before the clock runs; the build's own actor start, model load and scheduling are timed);
- one node / two nodes: a real cluster (``lib.cluster.RayCluster``: ``ray start`` processes, 1 CPU per
  node, each node pinned to a core of its own, so a node computes on one core as a 1-core machine would),
  first the head alone, then with a second node joined. The driver (listing, the sync plan, the index
  writes) runs on the head's core, as ``build-index`` run on the head machine would: left free, it took
  the core the second node needs, so one node had a core to itself beside the driver's and two did not
  (``--free-driver`` measures that way: 1.83x at 1,000 images under load, 1.53x at 3,000 on a quiet
  machine).
The Ray overhead per image is (Ray build time - local build time) / images. Files are read once before
timing (page cache). The load average is recorded at the start and the end: on a shared machine every
figure moves with the other work, so compare the ratios, measured minutes apart in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lib.cluster import RayCluster
from lib.images import make_image
from lib.options import bench_parser, data_option, model_option, out_option
from PIL import Image

from engine.build.indexing import build_index
from engine.build.ray_runner import RayRunner
from engine.build.report import BuildReport
from engine.gallery.files import list_images
from engine.model.embedder import Embedder
from foundation.atomic import atomic_write_text

HEAD_CORE = 0  # RayCluster(pin_cores=True) runs node k on core k: the head is node 0


def _model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    path = args.work / "model" / "model.onnx"
    if not path.exists():
        from training.backbone import BACKBONES, create_backbone
        from training.export import export_onnx
        from training.model import EmbeddingModel

        path.parent.mkdir(parents=True, exist_ok=True)
        export_onnx(
            EmbeddingModel(create_backbone("efficientnet_lite0")),
            path,
            preprocessing=BACKBONES["efficientnet_lite0"].preprocessing,
            backbone="efficientnet_lite0",
        )
    return path


def _gallery(args: argparse.Namespace) -> Path:
    gallery = args.work / f"gallery_{args.count}"
    if gallery.exists():
        return gallery
    gallery.mkdir(parents=True)
    if args.data is not None:
        for i, source in enumerate(list_images(args.data)[: args.count]):
            folder = gallery / f"class_{i % 10}"
            folder.mkdir(exist_ok=True)
            shutil.copy(source, folder / source.name)
    else:
        for i in range(args.count):
            folder = gallery / f"class_{i % 10}"
            folder.mkdir(exist_ok=True)
            make_image(i, (224, 224)).save(folder / f"img_{i:05d}.png")
    return gallery


def _timed(build: Callable[[Path], BuildReport], scratch: Path) -> dict[str, float]:
    out = scratch / f"index_{time.monotonic_ns()}"
    started = time.perf_counter()
    report = build(out)
    seconds = time.perf_counter() - started
    shutil.rmtree(out)
    return {
        "images": report.indexed,
        "seconds": round(seconds, 2),
        "img_per_s": round(report.indexed / seconds, 1),
    }


def main() -> None:
    parser = bench_parser(
        __doc__, data_option(required=False), model_option(), out_option(Path("bench/results/cluster_build"))
    )
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "dmlsearch" / "cluster_build")
    parser.add_argument(
        "--free-driver", action="store_true", help="leave the driver on every core (the cluster rows)"
    )
    args = parser.parse_args()
    model, gallery = _model(args), _gallery(args)
    files = list_images(gallery)
    for path in files:  # into the page cache before any timing
        path.read_bytes()
    Image.init()
    embedder = Embedder(model)
    scratch = Path(tempfile.mkdtemp(prefix="cluster_build_"))
    load_start = os.getloadavg()
    results: dict[str, dict[str, float]] = {}

    def build_with(runner: object) -> Callable[[Path], BuildReport]:
        return lambda out: build_index(gallery, embedder, out, progress=False, runner=runner)

    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="dmlray", dir="/tmp")), cpus_per_node=1, pin_cores=True)
    # The cluster's token, before Ray is imported (it reads its authentication settings then).
    os.environ.update({name: cluster.env[name] for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
    try:
        results["local"] = _timed(lambda out: build_index(gallery, embedder, out, progress=False), scratch)
        started = time.perf_counter()
        with RayRunner() as runner:
            ray_start = time.perf_counter() - started
            results["ray_local"] = _timed(build_with(runner), scratch)
        every_core = os.sched_getaffinity(0)
        if not args.free_driver:  # Ray's driver threads start in RayRunner and inherit it
            os.sched_setaffinity(0, {HEAD_CORE})
        try:
            cluster.start(workers=0)
            with RayRunner(cluster.address) as runner:
                results["one_node"] = _timed(build_with(runner), scratch)
            cluster.add_worker()
            with RayRunner(cluster.address) as runner:
                results["two_nodes"] = _timed(build_with(runner), scratch)
        finally:
            os.sched_setaffinity(0, every_core)
            cluster.stop()
            shutil.rmtree(cluster.root, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    images = len(files)
    ray_vs_local = results["ray_local"]["img_per_s"] / results["local"]["img_per_s"]
    two_vs_one = results["two_nodes"]["img_per_s"] / results["one_node"]["img_per_s"]
    overhead_ms = 1000 * (results["ray_local"]["seconds"] - results["local"]["seconds"]) / images
    summary = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "gallery": str(args.data or "generated 224-px PNGs"),
        "images": images,
        "model": str(model),
        "cpus": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "ray_runtime_start_s": round(ray_start, 2),
        "results": results,
        "ray_vs_local": round(ray_vs_local, 3),
        "two_nodes_vs_one": round(two_vs_one, 3),
        "ray_overhead_ms_per_image": round(overhead_ms, 2),
        "driver": "every core" if args.free_driver else f"core {HEAD_CORE} (the head node's)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(summary, indent=2))
    rows = "\n".join(
        f"| {name} | {r['images']} | {r['seconds']} | {r['img_per_s']} |" for name, r in results.items()
    )
    atomic_write_text(
        args.out.with_suffix(".md"),
        f"# build-index on Ray ({images} images, {os.cpu_count()} CPUs)\n\n"
        f"`{summary['command']}`\n\n"
        f"Load average at start {load_start}, at end {summary['load_average_end']} (a machine shared with "
        "other work: the figures move with it).\n\n"
        "| build | images | seconds | img/s |\n|---|---|---|---|\n"
        f"{rows}\n\n"
        f"- Ray (local runtime) against the local build: **{ray_vs_local:.2f}x** (goal >= 0.8x); the Ray "
        f"runtime's own start, {ray_start:.1f} s, is not counted.\n"
        f"- Two nodes against one, 1 CPU each (each node pinned to a core of its own; the driver "
        f"{'on every core' if args.free_driver else 'on the head node core'}): **{two_vs_one:.2f}x** "
        "(goal >= 1.6x).\n"
        f"- Overhead Ray adds: **{overhead_ms:.1f} ms per image** (Ray build time minus local, per image).\n",
    )
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
