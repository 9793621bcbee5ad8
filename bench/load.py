"""Load test of the HTTP API: a real uvicorn server on loopback, N concurrent clients for a bounded time.

    python bench/load.py [--data CARS196/images] [--clients 16] [--duration 60]

The gallery is a Cars196 index (the first ``--gallery-size`` test-class images of ``--data``) when the data
is there, the generated demo gallery otherwise. Queries mix the data set's small crops with 12-megapixel
phone-sized JPEGs (4000x3000, upscaled with sensor-like noise so they compress like real photos).

All from one run, printed and written to ``--out`` (JSON):

* under load: throughput, p50/p95/p99 end-to-end latency per query kind, error count, server memory (RSS)
  after warm-up, every 10 s and after the load, and the server's own per-stage times (upload, queue,
  decode, preprocess, embed, search) from the responses;
* single queries, one at a time: the end-to-end p50 next to the sum of the p50s of its stages measured
  alone in this process (decode + preprocess with the server's settings, bare onnxruntime inference of the
  same model with the same threads, the index search), interleaved query by query so both see the same
  background load: the service overhead ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from lib.options import bench_parser, data_option, model_option, out_option, threads_option
from lib.servers import serving
from PIL import Image

from engine.build.indexing import build_index
from engine.decode.images import decode_image
from engine.gallery.demo import write_demo_gallery
from engine.gallery.files import list_images
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex

PHONE_SIZE = (4000, 3000)  # 12 megapixels


@dataclass(frozen=True)
class Query:
    kind: str  # "crop" (a gallery-sized image) or "12mp"
    name: str
    data: bytes


@dataclass
class LoadResult:
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    stages_ms: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_mb: list[float] = field(default_factory=list)  # the server's, once a second


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q), 2) for q in (50, 95, 99)} | {"n": len(values)}


def phone_jpeg(source: Path, seed: int) -> bytes:
    """A 12-MP JPEG from a small image: upscaled, plus sensor-like noise so it compresses like a photo."""
    image = Image.open(source).convert("RGB").resize(PHONE_SIZE, Image.Resampling.BICUBIC)
    noise = np.random.default_rng(seed).normal(0, 6, (PHONE_SIZE[1], PHONE_SIZE[0], 3))
    noisy = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def prepare_gallery(args: argparse.Namespace, workdir: Path, embedder: Embedder) -> tuple[Path, list[Path]]:
    """Build the index; return it and the image files queries are made from."""
    if args.data is not None and args.data.is_dir():
        from training.data import load_labelled_images, split_classes

        data = load_labelled_images(args.data)
        files = data.files(split_classes(data).test[: args.gallery_size])
        gallery = workdir / "gallery"
        for path in files:  # symlinks: the index records paths under its own gallery root
            link = gallery / path.parent.name / path.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path.resolve())
        source = f"cars196 test classes, first {len(files)} images"
    else:
        gallery = workdir / "gallery"
        write_demo_gallery(gallery)
        files = list_images(gallery)
        source = "generated demo gallery"
    index_dir = workdir / "index"
    report = build_index(gallery, embedder, index_dir, progress=True)
    print(f"gallery: {source}; indexed {report.indexed}", flush=True)
    return index_dir, files


def server_args(args: argparse.Namespace, index_dir: Path) -> list[str]:
    """``serve``'s arguments: the index and model measured, no rate limit, the threads and slots asked for."""
    return [
        *("--index", str(index_dir), "--model", str(args.model), "--threads", str(args.threads)),
        *("--rate-limit", "0", "--compute-slots", str(args.compute_slots)),
    ]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def search_once(http: httpx.Client, url: str, query: Query, k: int) -> tuple[float, dict | None, str | None]:
    started = time.perf_counter()
    try:
        response = http.post(f"{url}/v1/search", params={"k": k}, files={"image": (query.name, query.data)})
        body = response.json()
    except (httpx.HTTPError, ValueError) as err:
        return (time.perf_counter() - started) * 1000.0, None, f"{type(err).__name__}: {err}"
    elapsed = (time.perf_counter() - started) * 1000.0
    if response.status_code != 200:
        return elapsed, None, f"HTTP {response.status_code}: {response.text[:200]}"
    return elapsed, body, None


def run_load(url: str, queries: list[Query], clients: int, seconds: float, k: int, pid: int) -> LoadResult:
    result = LoadResult()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def sample_memory() -> None:
        while time.monotonic() < deadline:
            result.rss_mb.append(rss_mb(pid))
            time.sleep(1.0)

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                query = queries[int(rng.integers(len(queries)))]
                elapsed, body, error = search_once(http, url, query, k)
                with lock:
                    if error is not None:
                        result.errors.append(error)
                        continue
                    result.latencies_ms[query.kind].append(elapsed)
                    for stage, ms in body["timings_ms"].items():
                        result.stages_ms[query.kind][stage].append(ms)

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    threads.append(threading.Thread(target=sample_memory))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    return result


class StagesAlone:
    """One query's stages run on their own in this process: decode + preprocess with the server's
    settings, bare onnxruntime inference of the same model with the same threads, the index search."""

    def __init__(self, model: Path, index_dir: Path, threads: int, k: int) -> None:
        import onnxruntime as ort

        self.embedder = Embedder(model, threads=threads)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self.input_name = self.session.get_inputs()[0].name
        self.index = GalleryIndex.open(index_dir)
        self.draft_size = self.embedder.card.preprocessing.resize_size
        self.k = k

    def run(self, data: bytes) -> dict[str, float]:
        started = time.perf_counter()
        tensor = self.embedder.preprocess([decode_image(data, draft_size=self.draft_size)])
        decoded = time.perf_counter()
        (vector,) = self.session.run(None, {self.input_name: tensor})
        inferred = time.perf_counter()
        self.index.search(vector, self.k)
        searched = time.perf_counter()
        return {
            "decode+preprocess": (decoded - started) * 1000.0,
            "onnxruntime": (inferred - decoded) * 1000.0,
            "search": (searched - inferred) * 1000.0,
        }


def single_query_overhead(url: str, alone: StagesAlone, query: Query, repeats: int, k: int) -> dict:
    """End-to-end p50 of sequential queries next to the sum of the p50s of their stages run alone.

    The two are interleaved (one query through the server, then its stages here) so that both see the
    same background load of the machine.
    """
    e2e, took, stages = [], [], defaultdict(list)
    with httpx.Client(timeout=120) as http:
        for _ in range(repeats):
            elapsed, body, error = search_once(http, url, query, k)
            if error is not None:
                raise SystemExit(f"single query failed: {error}")
            e2e.append(elapsed)
            took.append(body["took_ms"])
            for stage, ms in alone.run(query.data).items():
                stages[stage].append(ms)
    stage_p50 = {stage: round(percentile(ms, 50), 2) for stage, ms in stages.items()}
    return {
        "e2e_p50_ms": round(percentile(e2e, 50), 2),
        "server_took_p50_ms": round(percentile(took, 50), 2),
        "stages_alone_p50_ms": stage_p50,
        "sum_of_stages_p50_ms": round(sum(stage_p50.values()), 2),
        "ratio": round(percentile(e2e, 50) / sum(stage_p50.values()), 3),
        "query_bytes": len(query.data),
    }


def main() -> None:
    # One OpenMP thread per FAISS search in this process too, as `dmlsearch serve` does, so that the stage
    # measured alone is the one the server runs. FAISS is imported lazily, after this line.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = bench_parser(
        __doc__,
        data_option("Cars196 images folder (default: the demo gallery)", required=False),
        model_option("model.onnx (default: export the pretrained backbone)"),
        threads_option(0, help="server onnxruntime threads (0 = all cores)"),
        out_option(Path("bench/results/load.json")),
    )
    parser.add_argument("--gallery-size", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    parser.add_argument("--share-12mp", type=float, default=0.25, help="share of 12-MP queries")
    parser.add_argument("--single-repeats", type=int, default=40)
    parser.add_argument(
        "--compute-slots", type=int, default=0, help="server compute slots (0 = one per core)"
    )
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        if args.model is None:
            from training.features import backbone_model

            args.model = backbone_model(workdir, "efficientnet_lite0")
        index_dir, files = prepare_gallery(args, workdir, Embedder(args.model, threads=args.threads))
        rng = np.random.default_rng(0)
        picks = rng.choice(len(files), size=min(32, len(files)), replace=False)
        crops = [Query("crop", files[i].name, files[i].read_bytes()) for i in picks]
        large = [Query("12mp", f"phone_{i}.jpg", phone_jpeg(files[i], seed=int(i))) for i in picks[:8]]
        # The mix: every query kind in proportion, 12-MP uploads at --share-12mp of the requests.
        repeats = max(1, round(len(crops) * args.share_12mp / max(1e-9, 1 - args.share_12mp) / len(large)))
        queries = crops + large * repeats

        # Quiet (its access log would interleave with this script's output); waited for up to 2 minutes.
        with serving(server_args(args, index_dir), log=Path(os.devnull), timeout=120) as server:
            url, pid = server.url, server.process.pid
            print(f"warm-up {args.warmup:.0f} s with {args.clients} clients", flush=True)
            run_load(url, queries, args.clients, args.warmup, args.k, pid)
            rss_before = rss_mb(pid)
            print(f"load {args.duration:.0f} s with {args.clients} clients", flush=True)
            load = run_load(url, queries, args.clients, args.duration, args.k, pid)
            rss_after = rss_mb(pid)
            print("single queries, one at a time, interleaved with their stages run alone", flush=True)
            alone = StagesAlone(args.model, index_dir, args.threads, args.k)
            overhead = {
                kind: single_query_overhead(url, alone, sample, args.single_repeats, args.k)
                for kind, sample in (("crop", crops[0]), ("12mp", large[0]))
            }

    requests = sum(len(v) for v in load.latencies_ms.values())
    result = {
        "gallery_size": len(files),
        "clients": args.clients,
        "duration_s": round(load.seconds, 1),
        "server_onnxruntime_threads": args.threads,
        "server_compute_slots": args.compute_slots or "one per core",
        "cpu_count": os.cpu_count(),
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "requests": requests,
        "throughput_rps": round(requests / load.seconds, 2),
        "errors": len(load.errors),
        "error_examples": load.errors[:5],
        "latency_ms_under_load": {kind: summary(ms) for kind, ms in load.latencies_ms.items()},
        "server_stage_p50_ms_under_load": {
            kind: {stage: round(percentile(ms, 50), 2) for stage, ms in stages.items()}
            for kind, stages in load.stages_ms.items()
        },
        "server_rss_mb": {
            "after_warmup": round(rss_before, 1),
            "after_load": round(rss_after, 1),
            "every_10s_under_load": [round(mb, 1) for mb in load.rss_mb[::10]],
        },
        "single_query_overhead": overhead,
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
