"""What decoding costs, per format and per hostile trick, and how the decode processes answer.

For every file of ``bench/lib/hostile_images.py`` (the costliest legitimate files, 49 MP in each format and
pixel mode, and the hostile ones): its size, what decoding it as an upload costs in a fresh process
without limits (peak memory over the process's start, CPU seconds; under a 4 GB address-space cap and a
``--measure-timeout`` so that a bomb cannot take the machine), and what ``engine.decode.pool`` answers
under the default limits (``foundation.defaults.DECODE_*``), with its wall time. Also the per-image cost of
the process hop: one small JPEG decoded in-process and through the pool, interleaved, and with ``--files DIR``
build-index's decode stage (``engine.build.prefetch`` with 2 threads, each decoding in-process as before or
waiting on one of 2 decode processes at the build's niceness) over the first ``--count`` JPEGs of DIR,
``--repeats`` times interleaved.

    python bench/decode_limits.py [--only NAME ...] [--files CARS196/images] [--hop-only]
                                  [--out bench/results/decode_limits]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lib.hostile_images import HOSTILE, LEGIT, encode, noise
from lib.options import bench_parser, out_option

from engine.build.prefetch import WORKER_NICENESS, decode_file, prefetch
from engine.decode.images import ImageDecodeError
from engine.decode.model_input import PixelBudget, decode_uploads
from engine.decode.pool import DecodePool, InProcessDecoder
from engine.model.model_card import Preprocessing

BUDGET = PixelBudget(draft_size=Preprocessing().resize_size)
MEASURE_CAP = 4 * 1024**3


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure_one(path: Path) -> None:
    """In this (fresh) process: decode the file as an upload, print peak MB over the start and CPU s."""
    resource.setrlimit(resource.RLIMIT_AS, (MEASURE_CAP, MEASURE_CAP))
    data = path.read_bytes()
    start_kb, cpu = status_kb("VmRSS"), time.process_time()
    try:
        decode_uploads([data], BUDGET, Preprocessing())
        outcome = "decoded"
    except ImageDecodeError as err:
        outcome = err.code
    except MemoryError:
        outcome = "MemoryError (4 GB cap)"
    print(
        json.dumps(
            {
                "peak_mb": (status_kb("VmHWM") - start_kb) / 1024,
                "cpu_s": time.process_time() - cpu,
                "outcome": outcome,
            }
        )
    )


def measure(path: Path, timeout: float) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--measure", str(path)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"peak_mb": None, "cpu_s": None, "outcome": f"still decoding after {timeout:g} s"}
    except (json.JSONDecodeError, IndexError):
        return {"peak_mb": None, "cpu_s": None, "outcome": f"died: exit {done.returncode}"}


def verdict(pool: DecodePool, data: bytes) -> dict:
    started = time.perf_counter()
    try:
        pool.run(decode_uploads, [data], BUDGET, Preprocessing())
        answer = "decoded"
    except ImageDecodeError as err:
        answer = f"{err.code}: {err.message}"
    except MemoryError as err:
        answer = f"MemoryError: {err}"
    return {"pool": answer, "pool_s": time.perf_counter() - started}


def hop_cost(pool: DecodePool, repeats: int = 200) -> dict:
    """Per-image ms of a 640x480 JPEG decoded in-process and through the pool, interleaved."""
    data = encode(noise(640, 480), "JPEG", quality=90)
    local, times = InProcessDecoder(), {"in_process": [], "pool": []}
    for _ in range(repeats):
        for name, decoder in (("in_process", local), ("pool", pool)):
            started = time.perf_counter()
            decoder.run(decode_uploads, [data], BUDGET, Preprocessing())
            times[name].append((time.perf_counter() - started) * 1000)
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    return {
        **{f"{name}_ms": value for name, value in median.items()},
        "ratio": median["pool"] / median["in_process"],
    }


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of this process and of ``pids`` (the decode workers), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def build_decode_rates(folder: Path, count: int, repeats: int) -> dict:
    """Build-index's decode stage, in-process threads against processes: images per second and CPU
    milliseconds per image (this process and the workers: on a loaded machine the steadier of the two)."""
    files = sorted(folder.rglob("*.jpg"))[:count]
    for path in files:  # read once: every run then reads from the page cache
        path.read_bytes()
    preprocessing = Preprocessing()
    rates: dict[str, list[float]] = {"threads": [], "processes": []}
    cpu_ms: dict[str, list[float]] = {"threads": [], "processes": []}
    with DecodePool(2, niceness=WORKER_NICENESS) as pool:
        workers = [
            child.pid for child in multiprocessing.active_children() if child.name == "dmlsearch-decode"
        ]
        for _ in range(repeats):
            for name, decoder in (("threads", InProcessDecoder()), ("processes", pool)):
                started, cpu = time.perf_counter(), cpu_seconds(workers)
                loaded = prefetch(
                    files, lambda f, d=decoder: d.run(decode_file, f, preprocessing), workers=2, depth=64
                )
                done = sum(1 for _ in loaded)
                rates[name].append(done / (time.perf_counter() - started))
                cpu_ms[name].append((cpu_seconds(workers) - cpu) * 1000 / done)
    ratios = [p / t for p, t in zip(rates["processes"], rates["threads"], strict=True)]
    return {"files": len(files), **rates, "ratios": ratios, "cpu_ms_per_image": cpu_ms}


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0], out_option(Path("bench/results/decode_limits")))
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--measure-timeout", type=float, default=60.0)
    parser.add_argument("--files", type=Path, help="a folder of JPEGs (Cars196) for the build-index rates")
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--hop-only", action="store_true", help="only the hop and build-index rates")
    args = parser.parse_args()
    if args.measure:
        measure_one(args.measure)
        return
    cases = {**{f"legit {k}": v for k, v in LEGIT.items()}, **{f"hostile {k}": v for k, v in HOSTILE.items()}}
    rows = []
    with DecodePool(1) as pool, tempfile.TemporaryDirectory() as folder:
        hop = hop_cost(pool)
        print(json.dumps(hop), flush=True)
        build = build_decode_rates(args.files, args.count, args.repeats) if args.files else None
        print(json.dumps(build), flush=True)
        for name, make in cases.items() if not args.hop_only else ():
            if args.only and name.split()[1] not in args.only:
                continue
            started = time.perf_counter()
            data = make()
            path = Path(folder) / "case"
            path.write_bytes(data)
            row = {"case": name, "bytes": len(data), "make_s": time.perf_counter() - started}
            row.update(measure(path, args.measure_timeout))
            row.update(verdict(pool, data))
            rows.append(row)
            print(json.dumps(row), flush=True)
    limits = pool.limits
    result = {
        "limits": {
            "cpu_s": limits.cpu_seconds,
            "wall_s": limits.wall_seconds,
            "memory_mb": limits.memory_bytes // 1024**2,
        },
        "hop": hop,
        "build_decode": build,
        "cases": rows,
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Decode costs and the decode processes' answers (`python bench/decode_limits.py`)",
        "",
        f"Limits: {limits.cpu_seconds:g} s CPU, {limits.wall_seconds:g} s wall, "
        f"{limits.memory_bytes // 1024**2} MB per image. Process hop, 640x480 JPEG, median of 200 "
        f"interleaved: {hop['in_process_ms']:.2f} ms in-process, {hop['pool_ms']:.2f} ms through the pool "
        f"({hop['ratio']:.2f}x).",
        *(
            [
                f"build-index's decode stage, {build['files']} JPEGs, 2 threads in-process against 2 decode "
                "processes, interleaved (img/s): in-process "
                + ", ".join(f"{rate:.1f}" for rate in build["threads"])
                + "; processes "
                + ", ".join(f"{rate:.1f}" for rate in build["processes"])
                + "; ratios "
                + ", ".join(f"{ratio:.2f}" for ratio in build["ratios"])
                + "; CPU ms per image in-process "
                + ", ".join(f"{ms:.1f}" for ms in build["cpu_ms_per_image"]["threads"])
                + ", processes (this process + the workers) "
                + ", ".join(f"{ms:.1f}" for ms in build["cpu_ms_per_image"]["processes"])
                + ".",
            ]
            if build
            else []
        ),
        "",
        "| case | bytes | unlimited: peak MB | CPU s | outcome | pool answer | pool s |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    for row in rows:
        peak = "-" if row["peak_mb"] is None else f"{row['peak_mb']:.0f}"
        cpu = "-" if row["cpu_s"] is None else f"{row['cpu_s']:.2f}"
        lines.append(
            f"| {row['case']} | {row['bytes']:,} | {peak} | {cpu} | {row['outcome']} | "
            f"{row['pool']} | {row['pool_s']:.2f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
