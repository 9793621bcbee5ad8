"""Memory per request and per process of a real server under an address-space cap (``prlimit --as``).

    python bench/request_memory.py --model artifacts/model/model.onnx --index artifacts/index

Starts ``dmlsearch serve`` with the default limits (50 MP per image, 100 MP per request, 64 images per
batch, one compute slot per core) under ``--address-space`` (2 GiB by default), then sends, one at a time,
the worst requests those limits allow: extreme aspect ratios, the largest image in every pixel mode, the
largest batches by count and by pixels, a batch over the pixel budget, and two of the largest images at
once (both compute slots). For each: the status, the server's peak RSS over the RSS before it (``VmHWM``
after resetting it through ``/proc/PID/clear_refs``) and the RSS after it. Also the idle server's RSS and
mapped address space (``VmSize``). Written to ``--out`` (JSON and a Markdown table beside it).
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from lib.options import bench_parser, model_option, out_option, threads_option
from lib.servers import ServerProcess, reset_peak, start_server, wait_ready
from PIL import Image

MB = 1024**2


def png(width: int, height: int, mode: str = "L", **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, "PNG", **save)
    return buffer.getvalue()


def photo_jpeg(seed: int, size: tuple[int, int] = (640, 480)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def measure(server: ServerProcess, send) -> dict:
    """Run ``send()`` (returns status codes); the server's peak and final RSS around it, in MB."""
    before = reset_peak(server)
    started = time.perf_counter()
    statuses = send()
    seconds = time.perf_counter() - started
    return {
        "status": statuses,
        "seconds": round(seconds, 2),
        "rss_before_mb": round(before / MB),
        "peak_over_before_mb": round((server.status("VmHWM") - before) / MB),
        "rss_after_mb": round(server.status("VmRSS") / MB),
    }


def main() -> None:
    parser = bench_parser(
        __doc__,
        model_option(default=Path("artifacts/model/model.onnx")),
        threads_option(1, help="onnxruntime threads"),
        out_option(Path("bench/results/request_memory.json")),
    )
    parser.add_argument("--index", type=Path, default=Path("artifacts/index"))
    parser.add_argument("--address-space", type=int, default=2 * 1024**3, help="RLIMIT_AS in bytes")
    args = parser.parse_args()

    big = {mode: png(7000, 7000, mode) for mode in ("L", "RGB", "RGBA", "LA", "I;16")}
    big["P+transparency"] = png(7000, 7000, "P", transparency=0)
    small = [photo_jpeg(seed) for seed in range(64)]
    server = start_server(
        [
            "--index",
            str(args.index),
            "--model",
            str(args.model),
            "--rate-limit",
            "0",
            "--threads",
            str(args.threads),
        ],
        address_space=args.address_space,
        log=Path(os.devnull),
    )
    wait_ready(server, timeout=120)
    process, url = server.process, server.url
    http = httpx.Client(timeout=600)

    def search(data: bytes) -> int:
        return http.post(f"{url}/v1/search", files={"image": ("q", data)}).status_code

    def batch(images: list[bytes]) -> int:
        files = [("images", (f"{i}", data)) for i, data in enumerate(images)]
        return http.post(f"{url}/v1/search/batch", files=files).status_code

    def at_once(data: bytes, count: int) -> list[int]:
        codes: list[int] = []
        threads = [threading.Thread(target=lambda: codes.append(search(data))) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sorted(codes)

    for data in small[:4]:  # warm up: model arena, worker threads
        search(data)
    batch(small[:8])
    idle = {"rss_mb": round(server.status("VmRSS") / MB), "vmsize_mb": round(server.status("VmSize") / MB)}
    cases = {
        "one 640x480 JPEG": lambda: search(small[0]),
        "1x100000 PNG": lambda: search(png(1, 100_000)),
        "100000x1 PNG": lambda: search(png(100_000, 1)),
        "2x20000 PNG": lambda: search(png(2, 20_000)),
        **{f"7000x7000 {mode} PNG (49 MP)": (lambda data=data: search(data)) for mode, data in big.items()},
        "batch of 64 640x480 JPEGs (count limit)": lambda: batch(small),
        "batch of 2 x 49 MP RGBA (pixel limit)": lambda: batch([big["RGBA"]] * 2),
        "batch of 8 x 49 MP L (over the pixel limit)": lambda: batch([big["L"]] * 8),
        "2 x 49 MP RGBA at once (both compute slots)": lambda: at_once(big["RGBA"], 2),
        "4 x 49 MP LA at once (more than the slots)": lambda: at_once(big["LA"], 4),
    }
    results = {}
    for name, send in cases.items():
        results[name] = measure(server, send)
        print(f"{name:48s} {results[name]}", flush=True)
    alive = process.poll() is None and httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    final = {"rss_mb": round(server.status("VmRSS") / MB), "vmsize_mb": round(server.status("VmSize") / MB)}
    process.terminate()
    process.wait(timeout=30)
    report = {
        "command": " ".join(sys.argv),
        "address_space_cap_mb": args.address_space // MB,
        "cpu_slots": len(os.sched_getaffinity(0)),
        "idle": idle,
        "after_all": final,
        "alive_after_all": alive,
        "requests": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"Server under `prlimit --as` = {args.address_space // MB} MiB, {report['cpu_slots']} compute slots. "
        f"Idle: RSS {idle['rss_mb']} MB, mapped {idle['vmsize_mb']} MB. After all: RSS {final['rss_mb']} MB; "
        f"still ready: {alive}.",
        "",
        "| request | status | seconds | peak RSS over before (MB) | RSS after (MB) |",
        "|---|---|---|---|---|",
    ]
    for name, row in results.items():
        cells = [name, row["status"], row["seconds"], row["peak_over_before_mb"], row["rss_after_mb"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
