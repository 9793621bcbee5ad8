"""Can the ``milvus`` pip package's ``milvus-server`` (Milvus 2.3.5 standalone) stop without losing data?

    python bench/milvus_server_stop.py child_sigterm launcher_sigint group_sigkill child_sigint group_sigterm

For each stop METHOD: a fresh data folder under OUT_DIR, ``milvus-server`` started with every port of its
own (the plain launcher, ``--etcd-port`` and ``ETCD_CONFIG_PATH`` for etcd's peer port, a flag for each
internal port: docs/milvus.md), a collection with 2,000 rows inserted and flushed and 300 more inserted,
then the stop, then starts on the same folder (up to 4, each waited for up to 180 s, 30 s apart), counting
the rows of the first that opens. About 5-10 minutes a method. One JSON line a method is appended to
``bench/results/milvus_server_stop.jsonl``.

Methods: ``child_sigterm`` / ``child_sigint``: the signal to the ``milvus`` process (Milvus's own shutdown),
waited for up to 300 s, then SIGKILL; ``launcher_sigint``: Ctrl+C to the launcher, its own stop (SIGTERM to
the server, SIGKILL 1 s later); ``group_sigterm``: SIGTERM to the process group, up to 300 s;
``group_sigkill``: a crash.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from lib.servers import free_port
from pymilvus import DataType, MilvusClient

logging.getLogger("pymilvus").setLevel(logging.CRITICAL)  # its reconnection tracebacks while a server is down

OUT = Path(__file__).parent / "results" / "milvus_server_stop.jsonl"
OUT_DIR = Path(tempfile.gettempdir())
FLUSHED, UNFLUSHED, DIM = 2000, 300, 16
START_TIMEOUT = 180
TRIES, GAP = 4, 30


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


class Server:
    def __init__(self, data: Path, port: int):
        self.data, self.port = data, port
        self.etcd, self.peer = free_port(), free_port()
        (data / "etcd.yaml").parent.mkdir(parents=True, exist_ok=True)
        (data / "etcd.yaml").write_text(
            f"listen-client-urls: http://localhost:{self.etcd}\nadvertise-client-urls: http://localhost:{self.etcd}\n"
            f"listen-peer-urls: http://localhost:{self.peer}\ninitial-advertise-peer-urls: http://localhost:{self.peer}\n"
            f"initial-cluster: default=http://localhost:{self.peer}\n"
        )
        self.proc = None
        # every internal port of its own: the launcher probes its defaults (13333, 53100, ...) upward and
        # another Milvus starting at the same time takes them between the probe and the bind
        self.ports = []
        for name in (
            "root-coord",
            "proxy-internal",
            "query-coord",
            "query-node",
            "index-coord",
            "index-node",
            "data-coord",
            "data-node",
        ):
            self.ports += [f"--{name}-port", str(free_port())]

    def start(self) -> float | None:
        (self.data / "logs").mkdir(parents=True, exist_ok=True)
        out = (self.data / "logs" / "launcher.log").open("ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "milvus-server"),
                "--data",
                str(self.data),
                "--proxy-port",
                str(self.port),
                "--etcd-port",
                str(self.etcd),
                *self.ports,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "ETCD_CONFIG_PATH": str(self.data / "etcd.yaml")},
        )
        while time.monotonic() - t0 < START_TIMEOUT:
            if self.proc.poll() is not None:
                log("launcher exited", self.proc.returncode)
                return None
            try:
                MilvusClient(f"http://127.0.0.1:{self.port}", timeout=2).get_server_version()
                return time.monotonic() - t0
            except Exception:
                time.sleep(1)
        return None

    def child(self) -> int | None:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        return int(out[0]) if out else None

    def alive(self, pid) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        st = Path(f"/proc/{pid}/stat")
        return st.exists() and st.read_text().split()[2] != "Z"

    def killall(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def wait_gone(server, pids, limit) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        server.proc.poll()
        if not any(server.alive(p) for p in pids if p):
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def count(uri, name) -> int:
    client = MilvusClient(uri, timeout=30)
    client.load_collection(name, timeout=120)
    rows = client.query(name, filter="", output_fields=["count(*)"], consistency_level="Strong")
    return int(rows[0]["count(*)"])


def run(method: str):
    data = Path(tempfile.mkdtemp(prefix=f"stopexp-{method}-", dir=OUT_DIR))
    server = Server(data, free_port())
    result = {"method": method, "data": str(data)}
    result["first_start_s"] = server.start()
    if result["first_start_s"] is None:
        result["error"] = "first start failed"
        server.killall()
        return result
    uri = f"http://127.0.0.1:{server.port}"
    client = MilvusClient(uri, timeout=30)
    schema = client.create_schema(auto_id=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("v", DataType.FLOAT_VECTOR, dim=DIM)
    index = client.prepare_index_params()
    index.add_index("v", index_type="FLAT", metric_type="COSINE")
    client.create_collection("c", schema=schema, index_params=index)
    rng = np.random.default_rng(0)
    rows = [{"id": i, "v": rng.random(DIM).tolist()} for i in range(FLUSHED + UNFLUSHED)]
    client.insert("c", rows[:FLUSHED])
    client.flush("c")
    client.insert("c", rows[FLUSHED:])
    result["count_before"] = count(uri, "c")
    client.close()
    time.sleep(5)
    child = server.child()
    launcher = server.proc.pid
    t0 = time.monotonic()
    if method == "launcher_sigint":  # the launcher's own stop: terminate(), 1 s, kill()
        os.kill(launcher, signal.SIGINT)
        result["stopped_s"] = wait_gone(server, [launcher, child], 60)
    elif method == "child_sigterm":  # SIGTERM to the milvus binary only: Milvus's own graceful stop
        os.kill(child, signal.SIGTERM)
        result["stopped_s"] = wait_gone(server, [child], 300)
    elif method == "child_sigint":
        os.kill(child, signal.SIGINT)
        result["stopped_s"] = wait_gone(server, [child], 300)
    elif method == "group_sigterm":  # the README's SIGTERM to the process group
        os.killpg(launcher, signal.SIGTERM)
        result["stopped_s"] = wait_gone(server, [child], 300)
    elif method == "group_sigkill":  # a crash
        os.killpg(launcher, signal.SIGKILL)
        result["stopped_s"] = wait_gone(server, [launcher, child], 30)
    result["stop_wall_s"] = round(time.monotonic() - t0, 1)
    if result["stopped_s"] is None:
        result["note"] = "not stopped in time: SIGKILL to the group"
    server.killall()
    log(method, "stopped", result)
    restarts = []
    for attempt in range(TRIES):
        started = server.start()
        entry = {"attempt": attempt, "start_s": started}
        if started is not None:
            try:
                entry["count"] = count(uri, "c")
            except Exception as err:
                entry["error"] = str(err)[:300]
        else:
            tail = data / "logs" / "milvus-stderr.log"
            entry["stderr_tail"] = tail.read_text(errors="replace")[-400:] if tail.exists() else ""
        restarts.append(entry)
        log(method, entry)
        if "count" in entry:
            break
        server.killall()
        time.sleep(GAP)
    result["restarts"] = restarts
    server.killall()
    shutil.rmtree(data, ignore_errors=True)  # 250 MB of unpacked binaries each
    return result


if __name__ == "__main__":
    for method in sys.argv[1:]:
        res = run(method)
        with OUT.open("a") as f:
            f.write(json.dumps(res) + "\n")
        log("RESULT", json.dumps(res))
