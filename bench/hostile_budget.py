"""A normal search beside hostile decode work (issue 43, class 2): how much later does it answer?

    python bench/hostile_budget.py  # writes bench/results/hostile_budget.json and .md

Makes a small gallery, a small seeded model (``--model`` takes another) and its index, and starts
``dmlsearch serve`` with its default decode limits (each image 5 s of CPU, each request 15 s in all), its
default compute slots (one per core, half of them for one client), no rate limit, under a 3 GB address-space
cap, trusting 127.0.0.1 as a proxy so that each simulated client has its own address (X-Forwarded-For).

First the usual time: ``--normal`` searches of a 640x480 JPEG, one after another, alone. Then each
scenario: the hostile requests start together (a ``/v1/search/batch`` of ``--batch`` progressive JPEGs whose
last scan repeats ``--batch-scans`` times, a second or so of CPU each; and two single uploads repeating it
``--single-scans`` times, over one image's CPU limit), and while any of them runs the normal client searches
again, one after another. Scenarios (``--addresses``): for each N, the hostile requests come from N
addresses: N = 1 sends all three from one; N > 1 sends one from each (the batch from the first, a costly
single upload from each of the others), so that N attackers hold N requests at once, more than the server
has compute slots from N = 3 on (2 cores). Reported: the normal searches' median and slowest time against
the usual ones, what each hostile request was answered and when, and the load average (1 minute) before
and after each part.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from lib.hostile_images import jpeg_repeated_scan
from lib.images import export_small_model, image_bytes, make_image, write_labelled_folder
from lib.options import bench_parser, out_option
from lib.servers import ServerProcess, serving

NORMAL_ADDRESS = "10.1.0.1"


def load() -> float:
    return round(os.getloadavg()[0], 2)


def post(server: ServerProcess, route: str, files: list, address: str) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = httpx.post(
        f"{server.url}{route}", files=files, headers={"X-Forwarded-For": address}, timeout=600
    )
    return response, time.perf_counter() - started


def normal_search(
    server: ServerProcess,
    query: bytes,
    refused: list[str] | None = None,
    queued: list[float | None] | None = None,
) -> float:
    """Seconds a normal search took; one not answered 200 is added to ``refused`` (status and code), or
    raises where there is none (the usual time). ``queued`` gets the seconds it waited for a compute slot
    (its answer's ``queue`` stage; None where not answered 200)."""
    response, seconds = post(server, "/v1/search", [("image", ("q.jpg", query))], NORMAL_ADDRESS)
    if response.status_code != 200:
        if refused is None:
            raise RuntimeError(f"a normal search got {response.status_code}: {response.text}")
        refused.append(f"{response.status_code} {response.json()['error']['code']} after {seconds:.1f} s")
    if queued is not None:
        ok = response.status_code == 200
        queued.append(round(response.json()["timings_ms"]["queue"] / 1000.0, 3) if ok else None)
    return seconds


def summary(seconds: list[float]) -> dict:
    return {
        "count": len(seconds),
        "median_s": round(statistics.median(seconds), 3),
        "max_s": round(max(seconds), 3),
    }


def answer(response: httpx.Response, seconds: float) -> dict:
    body = response.json()
    error = body.get("error") if isinstance(body, dict) else None
    return {
        "status": response.status_code,
        "code": error["code"] if error else None,
        "message": error["message"] if error else None,
        "seconds": round(seconds, 2),
    }


def hostile_addresses(count: int) -> list[str]:
    """Whom each hostile request comes from: the batch and two singles from one address, or one request
    from each of ``count`` addresses (the first the batch)."""
    return ["10.6.6.6"] * 3 if count == 1 else [f"10.6.6.{number}" for number in range(1, count + 1)]


def scenario(server: ServerProcess, name: str, addresses: list[str], attack: dict, query: bytes) -> dict:
    """The hostile requests from ``addresses`` (a batch from the first, a single from each other), a normal
    client searching beside."""
    batch = [("images", (f"{i}.jpg", attack["batch"])) for i in range(attack["batch_count"])]
    requests = [("batch", "/v1/search/batch", batch, addresses[0])] + [
        (f"single {number}", "/v1/search", [("image", (f"s{number}.jpg", attack["single"]))], address)
        for number, address in enumerate(addresses[1:], start=1)
    ]
    answers: dict[str, dict] = {}
    started = time.perf_counter()

    def send(label: str, route: str, files: list, address: str) -> None:
        response, seconds = post(server, route, files, address)
        answers[label] = answer(response, seconds)
        answers[label]["ended_at_s"] = round(time.perf_counter() - started, 2)

    threads = [threading.Thread(target=send, args=request) for request in requests]
    before = load()
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the hostile bodies are received and their decodes under way
    normal: list[float] = []
    refused: list[str] = []
    while any(thread.is_alive() for thread in threads):
        normal.append(normal_search(server, query, refused))
    for thread in threads:
        thread.join()
    return {
        "scenario": name,
        "addresses": addresses,
        "load_before": before,
        "load_after": load(),
        "normal": summary(normal),
        "normal_refused": refused,
        "hostile": answers,
    }


def markdown(result: dict) -> str:
    usual = result["usual"]
    lines = [
        "# A normal search beside hostile decode work (issue 43, class 2)",
        "",
        f"`python bench/hostile_budget.py {' '.join(result['argv'])}`; {result['cores']} cores, shared; "
        f"decode limits: the server's defaults; batch of {result['batch']} JPEGs repeating a scan "
        f"{result['batch_scans']} times ({result['batch_bytes']:,} bytes each), singles repeating it "
        f"{result['single_scans']} times ({result['single_bytes']:,} bytes).",
        "",
        f"Usual time (alone, {usual['count']} searches): median {usual['median_s']} s, slowest "
        f"{usual['max_s']} s; load average {result['usual_load']}.",
        "",
        "| scenario | normal searches | median s | slowest s | slowest - usual slowest | load before/after | "
        "hostile requests: answer, when |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["scenarios"]:
        normal, hostile = row["normal"], row["hostile"]
        cells = [
            f"{label}: {answer['status']} {answer['code'] or ''} at {answer['ended_at_s']} s"
            for label, answer in sorted(hostile.items())
        ]
        lines.append(
            f"| {row['scenario']} | {normal['count']} | {normal['median_s']} | {normal['max_s']} | "
            f"{normal['max_s'] - usual['max_s']:+.3f} | {row['load_before']}/{row['load_after']} | "
            + "; ".join(cells)
            + " |"
        )
    lines += ["", "Normal searches not answered 200:", ""]
    for row in result["scenarios"]:
        lines.append(f"- {row['scenario']}: {', '.join(row['normal_refused']) or 'none'}")
    lines += ["", "What the hostile requests were told:", ""]
    for row in result["scenarios"]:
        for label, hostile in row["hostile"].items():
            lines.append(f"- {row['scenario']}, {label}: {hostile['status']} {hostile['message']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/hostile_budget.json")))
    parser.add_argument("--model", type=Path, help="model.onnx (default: a small seeded model made here)")
    parser.add_argument("--address-space", type=int, default=3_000_000_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-scans", type=int, default=30)
    parser.add_argument("--single-scans", type=int, default=1000)
    parser.add_argument("--normal", type=int, default=20, help="normal searches alone, for the usual time")
    parser.add_argument(
        "--addresses",
        type=lambda text: [int(count) for count in text.split(",")],
        default=[1, 3, 5],
        help="the scenarios: how many hostile addresses, comma-separated",
    )
    args = parser.parse_args()
    attack = {
        "batch": jpeg_repeated_scan(args.batch_scans),
        "batch_count": args.batch,
        "single": jpeg_repeated_scan(args.single_scans),
    }
    query = image_bytes(make_image(3, (640, 480)), "JPEG", quality=90)
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        gallery = write_labelled_folder(work / "gallery", classes=4, per_class=4)
        model = args.model or export_small_model(work / "model" / "model.onnx", seed=7)
        build = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--model", str(model)]
        subprocess.run([*build, "--out", str(work / "index")], check=True, capture_output=True)
        serve = ["--index", str(work / "index"), "--model", str(model), "--rate-limit", "0"]
        serve += ["--trusted-proxy", "127.0.0.1"]
        with serving(serve, address_space=args.address_space, log=work / "server.log") as server:
            for _ in range(3):  # warm-up
                normal_search(server, query)
            usual_load = load()
            usual = summary([normal_search(server, query) for _ in range(args.normal)])
            scenarios = [
                scenario(server, f"{count} hostile address(es)", hostile_addresses(count), attack, query)
                for count in args.addresses
            ]
    result = {
        "argv": sys.argv[1:],
        "cores": len(os.sched_getaffinity(0)),
        "batch": args.batch,
        "batch_scans": args.batch_scans,
        "batch_bytes": len(attack["batch"]),
        "single_scans": args.single_scans,
        "single_bytes": len(attack["single"]),
        "usual": usual,
        "usual_load": usual_load,
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
