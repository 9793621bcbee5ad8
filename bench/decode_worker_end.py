"""What ending a lowered decode worker that holds a large decode costs its caller, with and without freeing
its memory in the caller's thread (``foundation.reaping``; issue 43).

    python bench/decode_worker_end.py  # writes bench/results/decode_worker_end.json and .md

A decode worker (``engine.decode.pool``'s ``_Worker``) takes a task that holds ``--mb`` MB, as a 49-MP decode
does, is lowered to niceness 19 as ``app.compute`` lowers a request in the background, and is ended (what a
request that was stopped does), beside ``--hogs`` CPU-bound processes at niceness 19 (other people's
background work on the shared cores). Timed: ``_Worker.end``, from the kill to the join's return, ``--runs``
times each way, interleaved: ``release`` (the kill followed by ``process_mrelease``) and ``plain`` (the kill
alone: the worker frees its memory itself, at niceness 19). The load average is read before each end.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lib.holding import hold
from lib.options import bench_parser, out_option

from engine.decode import pool
from engine.decode.pool import PRELOAD, DecodeLimits, _Worker
from foundation.priority import LOWERED_NICENESS
from foundation.reaping import kill_and_release


def _anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _kill_only(pid: int) -> bool:
    """What ``_Worker.end`` did before the release: a SIGKILL, the worker frees its memory itself."""
    os.kill(pid, 9)
    return False


@contextmanager
def hogs(count: int) -> Iterator[None]:
    """``count`` CPU-bound processes at niceness 19."""
    spin = [sys.executable, "-c", "while True: pass"]
    spinning = [subprocess.Popen(spin, preexec_fn=lambda: os.nice(LOWERED_NICENESS)) for _ in range(count)]
    try:
        time.sleep(1.0)
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def timed_end(context: multiprocessing.context.BaseContext, nbytes: int, release: bool) -> dict:
    """One worker, holding ``nbytes`` in a task, lowered, then ended; the seconds ``end`` took."""
    worker = _Worker(context, 2 * nbytes, 0)
    worker.tasks.send((hold, (nbytes, 600.0), {}, DecodeLimits(cpu_seconds=600, request_cpu_seconds=600)))
    while _anon_bytes(worker.process.pid or 0) < nbytes:
        time.sleep(0.05)
    worker.lower()
    time.sleep(0.5)  # lowered a while, as a request in the background
    pool.kill_and_release = kill_and_release if release else _kill_only
    load = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    worker.end()
    return {"seconds": round(time.perf_counter() - started, 4), "load": load}


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/decode_worker_end.json")))
    parser.add_argument("--mb", type=int, default=800, help="what the worker's task holds")
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes at niceness 19 beside it")
    parser.add_argument("--runs", type=int, default=8, help="ends timed each way")
    args = parser.parse_args()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    runs: dict[str, list[dict]] = {"release": [], "plain": []}
    with hogs(args.hogs):
        for index in range(2 * args.runs):
            mode = "release" if index % 2 == 0 else "plain"
            runs[mode].append(timed_end(context, args.mb * 1024**2, mode == "release"))
            print(mode, runs[mode][-1], flush=True)
    result = {
        "argv": sys.argv[1:],
        "cores": len(os.sched_getaffinity(0)),
        "runs": runs,
        **{
            f"{mode}_{name}_s": round(pick([run["seconds"] for run in rows]), 4)
            for mode, rows in runs.items()
            for name, pick in (("median", statistics.median), ("max", max))
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Ending a lowered decode worker that holds a large decode, with and without the release (issue 43)",
        "",
        f"`python bench/decode_worker_end.py {' '.join(result['argv'])}`; {result['cores']} cores, shared; "
        f"a worker holding {args.mb} MB, at niceness 19, beside {args.hogs} CPU-bound processes at "
        "niceness 19; runs interleaved, release first.",
        "",
        "| `_Worker.end` | median s | slowest s | each run s (load average before it) |",
        "|---|---|---|---|",
    ]
    for mode, rows in runs.items():
        each = ", ".join(f"{run['seconds']} ({run['load']})" for run in rows)
        lines.append(f"| {mode} | {result[f'{mode}_median_s']} | {result[f'{mode}_max_s']} | {each} |")
    markdown = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
