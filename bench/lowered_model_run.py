"""A normal query's model run beside requests moved to the background, their runs lowered or not (issue 43).

    python bench/lowered_model_run.py  # writes bench/results/lowered_model_run.json and .md

In one process, as in the server: ``--background`` threads each run the model on batches of 64 images again
and again (a ``/v1/search/batch`` of cheap images whose cost is the model run), in ``lowered_by`` an event
that is set (``--mode lowered``: what ``app.compute`` does to a request in the background) or not
(``--mode plain``: the model run as it was before, at the server's priority in onnxruntime's shared
threads), while the main thread times ``--runs`` model runs of one image. Same embedder for both modes
(``--threads`` intra-op threads, the server's default 0 = every core). Reported: the one-image run's median
and slowest, alone and beside each mode, and the load average.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from lib.images import export_small_model, make_image
from lib.options import bench_parser, model_option, out_option

from engine.model.embedder import Embedder
from foundation.priority import lowered_by


def timed_runs(embedder: Embedder, runs: int) -> dict:
    one = embedder.preprocess([make_image(1, (96, 96))])
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        embedder.run_tensor(one)
        times.append(time.perf_counter() - started)
    return {"median_s": round(statistics.median(times), 4), "max_s": round(max(times), 4), "runs": runs}


def beside(embedder: Embedder, background: int, lowered: bool, runs: int) -> dict:
    batch = embedder.preprocess([make_image(100 + i, (96, 96)) for i in range(64)])
    stop = threading.Event()
    event = threading.Event()
    if lowered:
        event.set()
    done = [0]

    def keep_running() -> None:
        with lowered_by(event):
            while not stop.is_set():
                embedder.run_tensor(batch)
                done[0] += 1

    threads = [threading.Thread(target=keep_running) for _ in range(background)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the background runs under way
    load_before = round(os.getloadavg()[0], 2)
    row = timed_runs(embedder, runs)
    stop.set()
    for thread in threads:
        thread.join()
    return {
        **row,
        "background_batches": done[0],
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/lowered_model_run.json")), model_option())
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--background", type=int, default=2)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        model = args.model or export_small_model(Path(temporary) / "model.onnx", seed=7)
        embedder = Embedder(model, threads=args.threads)
        timed_runs(embedder, 5)  # warm-up
        result = {
            "argv": sys.argv[1:],
            "cores": len(os.sched_getaffinity(0)),
            "alone": {**timed_runs(embedder, args.runs), "load": round(os.getloadavg()[0], 2)},
            "plain": beside(embedder, args.background, False, args.runs),
            "lowered": beside(embedder, args.background, True, args.runs),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# A normal query's model run beside background requests' model runs (issue 43)",
        "",
        f"`python bench/lowered_model_run.py {' '.join(result['argv'])}`; {result['cores']} cores, shared; "
        f"{args.background} threads running batches of 64 images beside one-image runs.",
        "",
        "| one-image run | median s | slowest s | background batches done | load average |",
        "|---|---|---|---|---|",
        "| alone | {median_s} | {max_s} | | {load} |".format(**result["alone"]),
    ]
    for mode in ("plain", "lowered"):
        row = result[mode]
        lines.append(
            f"| beside {mode} runs | {row['median_s']} | {row['max_s']} | {row['background_batches']} | "
            f"{row['load_before']}-{row['load_after']} |"
        )
    markdown = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
