"""Attacking the fair share of compute slots (issue 43, class 2): hostile clients that keep at it.

    python bench/hostile_fairness.py  # writes bench/results/hostile_fairness.json and .md

``bench/hostile_budget.py`` sends each hostile request once. Here each hostile client (its own address)
sends its request again and again for ``--seconds``, while a normal client searches one query after another;
the requests are of other kinds than that bench's, chosen against what the scheduler (``app.compute``) does:
- ``tiny batch``: ``/v1/search/batch`` of 64 small distinct PNGs: cheap to decode, so its cost is the model
  run of 64 images, in the server process (lowered in the background with its decodes since 39fde77);
- ``thumbnails``: a thumbnail of a costly gallery file (a progressive JPEG repeating a scan
  ``--gallery-scans`` times, which build-index accepts) at a size not asked before, so no cache helps:
  legitimate slow work too, which must end (the share of its answers that are 200 is reported);
- ``explain``: ``/v1/explain`` of that gallery file against itself (two decodes of it and the explainer);
- ``restart markers``: a 1750x1750 noise JPEG with a restart marker after every block;
- ``scans``: a progressive JPEG repeating its last scan ``--single-scans`` times (a decode's whole limit).
Same server set-up as ``bench/hostile_budget.py`` (3 GB address-space cap, 127.0.0.1 a trusted proxy, no
rate limit). Reported: the normal searches' median and slowest time against the usual ones, what each hostile
client got (answers by status and code, its slowest), and the load average before and after.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
from hostile_budget import NORMAL_ADDRESS, load, normal_search, summary
from lib.hostile_images import jpeg_repeated_scan, jpeg_restart_every_block
from lib.images import export_small_model, image_bytes, make_image, write_labelled_folder
from lib.options import bench_parser, out_option
from lib.servers import ServerProcess, serving

Send = Callable[[httpx.Client, str], httpx.Response]


def attackers(server: ServerProcess, costly_item: int, single_scans: int) -> dict[str, Send]:
    """Each hostile client's request, by name: ``send(client, address)``."""
    tiny = [("images", (f"{i}.png", image_bytes(make_image(5000 + i, (96, 96))))) for i in range(64)]
    restart = jpeg_restart_every_block()
    scans = jpeg_repeated_scan(single_scans)
    sizes = itertools.count(16)

    def headers(address: str) -> dict[str, str]:
        return {"X-Forwarded-For": address}

    def tiny_batch(client: httpx.Client, address: str) -> httpx.Response:
        return client.post(f"{server.url}/v1/search/batch", files=tiny, headers=headers(address))

    def thumbnails(client: httpx.Client, address: str) -> httpx.Response:
        size = 16 + (next(sizes) - 16) % 1009
        route = f"{server.url}/v1/items/{costly_item}/thumbnail?size={size}"
        return client.get(route, headers=headers(address))

    def explain(client: httpx.Client, address: str) -> httpx.Response:
        params = {"item": costly_item, "query_item": costly_item}
        return client.get(f"{server.url}/v1/explain", params=params, headers=headers(address))

    def upload(data: bytes) -> Send:
        def send(client: httpx.Client, address: str) -> httpx.Response:
            files = [("image", ("hostile.jpg", data))]
            return client.post(f"{server.url}/v1/search", files=files, headers=headers(address))

        return send

    return {
        "tiny batch": tiny_batch,
        "thumbnails": thumbnails,
        "explain": explain,
        "restart markers": upload(restart),
        "scans": upload(scans),
    }


def keep_sending(send: Send, address: str, until: float, tally: dict) -> None:
    """``send`` again and again until ``until`` (monotonic), counting the answers."""
    answers: Counter[str] = Counter()
    slowest = 0.0
    with httpx.Client(timeout=600) as client:
        while time.monotonic() < until:
            started = time.monotonic()
            response = send(client, address)
            slowest = max(slowest, time.monotonic() - started)
            body = response.json() if response.headers.get("content-type") == "application/json" else {}
            code = body.get("error", {}).get("code", "") if isinstance(body, dict) else ""
            answers[f"{response.status_code} {code}".strip()] += 1
    tally.update(answers=dict(answers), slowest_s=round(slowest, 2))


def attack(
    server: ServerProcess, sends: dict[str, Send], seconds: float, query: bytes, addresses: str = "10.6.7.{}"
) -> dict:
    """Every hostile client at once, each from its own address (``addresses`` formatted with its number),
    while the normal client searches."""
    until = time.monotonic() + seconds
    tallies: dict[str, dict] = {name: {} for name in sends}
    threads = [
        threading.Thread(target=keep_sending, args=(send, addresses.format(number), until, tallies[name]))
        for number, (name, send) in enumerate(sends.items(), start=1)
    ]
    before = load()
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the hostile requests under way
    normal: list[float] = []
    queued: list[float | None] = []
    refused: list[str] = []
    while any(thread.is_alive() for thread in threads):
        normal.append(normal_search(server, query, refused, queued))
    for thread in threads:
        thread.join()
    return {
        "load_before": before,
        "load_after": load(),
        "normal": summary(normal),
        "slowest_queued_s": queued[normal.index(max(normal))],  # of it, waiting for a compute slot
        "normal_refused": refused,
        "hostile": tallies,
    }


def queued_line(row: dict) -> str:
    """Where the slowest normal search's time went: how much of it waiting for a compute slot."""
    return f"{row['slowest_queued_s']} s of it waiting for a compute slot"


def markdown(result: dict) -> str:
    usual, row = result["usual"], result["attack"]
    lines = [
        "# Attacking the fair share of compute slots (issue 43, class 2)",
        "",
        f"`python bench/hostile_fairness.py {' '.join(result['argv'])}`; {result['cores']} cores, shared; "
        f"{len(row['hostile'])} hostile clients, each from its own address ({result['addresses']}), for "
        f"{result['seconds']} s; the "
        f"server's defaults otherwise (rate limit off), under a 3 GB address-space cap.",
        "",
        f"Usual time (alone, {usual['count']} searches): median {usual['median_s']} s, slowest "
        f"{usual['max_s']} s; load average {result['usual_load']}.",
        "",
        f"Beside the attack ({row['normal']['count']} searches): median {row['normal']['median_s']} s, "
        f"slowest {row['normal']['max_s']} s ({row['normal']['max_s'] - usual['max_s']:+.3f} s against the "
        f"usual slowest; {queued_line(row)}); load average {row['load_before']} before, {row['load_after']} "
        f"after. Not answered 200: {', '.join(row['normal_refused']) or 'none'}; /healthz after: "
        f"{row['healthz_after']}.",
        "",
        "| hostile client | answers | its slowest s |",
        "|---|---|---|",
    ]
    for name, tally in row["hostile"].items():
        answers = ", ".join(f"{count} x {status}" for status, count in sorted(tally["answers"].items()))
        lines.append(f"| {name} | {answers} | {tally['slowest_s']} |")
    thumbnails = row["hostile"]["thumbnails"]["answers"]
    lines += [
        "",
        f"Legitimate slow work (thumbnails of the costly gallery file): {thumbnails.get('200', 0)} of "
        f"{sum(thumbnails.values())} answered 200.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/hostile_fairness.json")))
    parser.add_argument("--model", type=Path, help="model.onnx (default: a small seeded model made here)")
    parser.add_argument("--address-space", type=int, default=3_000_000_000)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the hostile clients go on")
    parser.add_argument("--gallery-scans", type=int, default=40)
    parser.add_argument("--single-scans", type=int, default=1000)
    parser.add_argument("--normal", type=int, default=10, help="normal searches alone, for the usual time")
    parser.add_argument(
        "--addresses",
        default="10.6.7.{}",
        help="the hostile clients' addresses, {} their number (2001:db8:6:7::{}: all in one IPv6 /64)",
    )
    args = parser.parse_args()
    query = image_bytes(make_image(3, (640, 480)), "JPEG", quality=90)
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        gallery = write_labelled_folder(work / "gallery", classes=4, per_class=4)
        (gallery / "class_00" / "costly.jpg").write_bytes(jpeg_repeated_scan(args.gallery_scans))
        model = args.model or export_small_model(work / "model" / "model.onnx", seed=7)
        build = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--model", str(model)]
        built = subprocess.run(
            [*build, "--out", str(work / "index")], check=True, capture_output=True, text=True
        )
        serve = ["--index", str(work / "index"), "--model", str(model), "--rate-limit", "0"]
        serve += ["--trusted-proxy", "127.0.0.1"]
        with serving(serve, address_space=args.address_space, log=work / "server.log") as server:
            items = httpx.get(f"{server.url}/v1/items", params={"limit": 1000}).json()["items"]
            costly = [item["id"] for item in items if item["path"].endswith("costly.jpg")]
            if len(costly) != 1:
                raise RuntimeError(f"build-index did not index costly.jpg:\n{built.stdout}{built.stderr}")
            for _ in range(3):  # warm-up
                normal_search(server, query)
            usual_load = load()
            usual = summary([normal_search(server, query) for _ in range(args.normal)])
            sends = attackers(server, costly[0], args.single_scans)
            row = attack(server, sends, args.seconds, query, args.addresses)
            alive = httpx.get(f"{server.url}/healthz", headers={"X-Forwarded-For": NORMAL_ADDRESS})
            row["healthz_after"] = alive.status_code
    result = {
        "argv": sys.argv[1:],
        "cores": len(os.sched_getaffinity(0)),
        "seconds": args.seconds,
        "addresses": args.addresses,
        "usual": usual,
        "usual_load": usual_load,
        "attack": row,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
