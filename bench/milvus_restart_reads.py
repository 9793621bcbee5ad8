"""How soon a restarted Milvus 2.3.5 (``milvus-server``) answers reads of collections written to before the
stop, flushed or not, at the ``Session``, ``Eventually`` and ``Strong`` levels; and what a flush costs.

    PYTHONPATH=. python bench/milvus_restart_reads.py

A fresh server; three collections of 2-d rows: ``unflushed`` (80 one-row upserts, as judgments arrive),
``flushed`` (the same, then one flush) and ``burst`` (10 one-row upserts, each followed by a flush: what a
flush per judgment would cost). The server is stopped as tests stop it (SIGTERM to its group, SIGKILL
after 10 s) and started again on its folder; from the moment it answers, each collection is read at each
level by a thread of its own (2 s a try, every 0.3 s), with the same client cache (the ``Session`` level's
last write time). Writes ``bench/results/milvus_restart_reads.md`` (issue 42; ``index.milvus_flush``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pymilvus import DataType, MilvusClient

from tests.support.milvus_server import running_milvus_server

logging.getLogger("pymilvus").setLevel(logging.CRITICAL)  # its reconnection tracebacks while a server is down

OUT = Path(__file__).parent / "results" / "milvus_restart_reads.md"
ROWS, BURST = 80, 10
LEVELS = ("Session", "Eventually", "Strong")
TRY_S, EVERY_S, GIVE_UP_S = 2.0, 0.3, 120.0


def _create(client: MilvusClient, name: str) -> None:
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=2)
    index = client.prepare_index_params()
    index.add_index("vector", index_type="FLAT", metric_type="L2")
    client.create_collection(name, schema=schema, index_params=index)


def _count(client: MilvusClient, name: str, level: str) -> int:
    rows = client.query(name, filter="id >= 0", limit=1000, consistency_level=level, timeout=TRY_S)
    return len(rows)


def main() -> int:
    lines = []
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    with running_milvus_server("bench-restart-reads-") as server:
        client = MilvusClient(server.uri, timeout=30)
        expected = {"unflushed": ROWS, "flushed": ROWS, "burst": BURST}
        for name in expected:
            _create(client, name)
        for name in ("unflushed", "flushed"):
            for i in range(ROWS):
                client.upsert(name, [{"id": i, "vector": [0.0, 0.0]}])
        started = time.monotonic()
        client.flush("flushed")
        lines.append(f"- one flush of `flushed` ({ROWS} rows): {time.monotonic() - started:.2f} s")
        costs = []
        for i in range(BURST):
            client.upsert("burst", [{"id": i, "vector": [0.0, 0.0]}])
            started = time.monotonic()
            client.flush("burst")
            costs.append(time.monotonic() - started)
        lines.append(
            f"- a flush after each of {BURST} one-row upserts: {', '.join(f'{c:.2f}' for c in costs)} s"
        )
        server.stop()
        client.close()
        started = time.monotonic()
        server.start()
        lines.append(f"- the server answered again {time.monotonic() - started:.1f} s after its start")
        answered = time.monotonic()
        client = MilvusClient(server.uri, timeout=30)
        full: dict[tuple[str, str], str] = {}

        def probe(name: str, level: str) -> None:
            seen = "none"
            while (took := time.monotonic() - answered) < GIVE_UP_S:
                try:
                    count = _count(client, name, level)
                except Exception as err:  # not loaded yet, or a timeout: tried again
                    seen = type(err).__name__
                else:
                    seen = f"{count} rows"
                    if count == expected[name]:
                        full[(name, level)] = f"{took:.1f} s"
                        return
                time.sleep(EVERY_S)
            full[(name, level)] = f"not within {GIVE_UP_S:g} s (last: {seen})"

        threads = [threading.Thread(target=probe, args=(n, lv)) for n in expected for lv in LEVELS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        client.close()
    loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
    table = ["| collection | " + " | ".join(LEVELS) + " |", "|---|" + "---|" * len(LEVELS)]
    for name in expected:
        table.append(f"| {name} | " + " | ".join(full[(name, lv)] for lv in LEVELS) + " |")
    report = [
        "# Reads of a restarted Milvus 2.3.5, flushed collections or not",
        "",
        "`PYTHONPATH=. python bench/milvus_restart_reads.py` (this file is its output). "
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, one shared 2-core machine, load average "
        f"at the start {loads[0]}, at the end {loads[1]}.",
        "",
        *lines,
        "",
        "Seconds from the server answering again until a read returned every row:",
        "",
        *table,
        "",
    ]
    OUT.write_text("\n".join(report))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
