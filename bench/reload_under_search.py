"""Promote by reload while searches run (the new-user trials of issues 39 and 40): does every search
answer during the swap, and does the served model change?

    python bench/reload_under_search.py --api http://127.0.0.1:8000 --index artifacts/index-mine \
        [--api-key KEY] [--item 1] [--before 3] [--after 3] [--per-second 10]

One client searches by ``--item`` (``GET /v1/items/{id}/similar``, 10 results), ``--per-second`` requests a
second (under the server's per-client rate limit, 20 by default, so that every answer is the search's own),
for ``--before`` seconds, then through ``POST /v1/admin/reload`` with ``{"index_path": INDEX}`` (the README's
promotion; the key from ``--api-key`` or ``DMLSEARCH_API_KEY``), then ``--after`` seconds more. It prints
the reload's answer and time, each model fingerprint that answered searches and how many it answered, every
status other than 200, and the slowest search. Exit 1 where a search got anything but 200 or the served
fingerprint did not change.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from lib.options import bench_parser


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--api", required=True)
    parser.add_argument("--index", type=Path, required=True, help="the index to promote (the server's path)")
    parser.add_argument("--api-key", default=os.environ.get("DMLSEARCH_API_KEY", ""))
    parser.add_argument("--item", type=int, default=1)
    parser.add_argument("--before", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=3.0)
    parser.add_argument("--per-second", type=float, default=10.0)
    args = parser.parse_args(argv)

    models: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    slowest = 0.0
    stop = threading.Event()

    def search() -> None:
        nonlocal slowest
        with httpx.Client(base_url=args.api, timeout=120) as client:
            while not stop.wait(1 / args.per_second):
                started = time.perf_counter()
                try:
                    response = client.get(f"/v1/items/{args.item}/similar", params={"k": 10})
                except httpx.HTTPError as err:
                    failures[type(err).__name__] += 1
                    continue
                slowest = max(slowest, time.perf_counter() - started)
                if response.status_code == 200:
                    models[response.json()["model_fingerprint"][:12]] += 1
                else:
                    failures[str(response.status_code)] += 1

    searcher = threading.Thread(target=search)
    searcher.start()
    time.sleep(args.before)
    started = time.perf_counter()
    reload = httpx.post(
        f"{args.api}/v1/admin/reload",
        json={"index_path": str(args.index)},
        headers={"X-API-Key": args.api_key},
        timeout=600,
    )
    took = time.perf_counter() - started
    time.sleep(args.after)
    stop.set()
    searcher.join()
    print(f"reload: {reload.status_code} in {took:.2f} s: {reload.text}")
    print(f"searches answered 200, by model: {dict(models)}; other answers: {dict(failures) or 'none'}")
    print(f"slowest search: {slowest:.2f} s")
    return 0 if reload.status_code == 200 and not failures and len(models) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
