"""A real Ray cluster on this machine, for bench/cluster_build.py and the tests of the Ray build; and the
process-group helpers its stop needs (the tests' Milvus server uses them too)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

from .servers import free_port

# Ray's command beside this interpreter: `make test` runs without the venv on PATH.
RAY_COMMAND = str(Path(sys.executable).with_name("ray"))


# A Ray node's start (its GCS, raylet and agents) on a loaded 2-core machine.
RAY_START_TIMEOUT_S = 120
RAY_STOP_GRACE_S = 10


class RayClusterUnavailable(RuntimeError):
    """A local Ray cluster cannot start on this machine (ray not installed, or a node never came up)."""


@dataclass
class RayCluster:
    """A real Ray cluster on this machine: a head and worker nodes started by ``ray start --block``, each
    in a process group of its own (so one node can be removed, and the stop reaches every process a node
    spawned without touching another Ray on the machine), with token authentication and temporary
    folders in ``root``.

    ``pin_cores``: run node k on core k (modulo the machine's cores, by CPU affinity, which every process
    the node starts inherits), so that a node's ``--num-cpus`` is also the compute it can use: two 1-CPU
    nodes on one machine then stand for two 1-core machines (a bench of scaling needs that; Ray's CPU count
    alone is only a scheduling label)."""

    root: Path
    cpus_per_node: int = 1
    pin_cores: bool = False
    port: int = 0
    nodes: list[subprocess.Popen] = dataclass_field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster needs: the project on its path, and the cluster's auth token
        (``ray start --head`` turns token authentication on; a client finds the token in
        ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``; Ray reads them when it is
        imported, so a client process must have them from its start)."""
        return {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.root / "auth_token"),
            "TMPDIR": str(self.root / "tmp"),  # the workers' model copies, removed with the cluster
        }

    def __post_init__(self) -> None:
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        (self.root / "auth_token").write_text(os.urandom(16).hex())

    def start(self, workers: int = 1) -> None:
        """Start the head and ``workers`` worker nodes."""
        if importlib.util.find_spec("ray") is None:
            raise RayClusterUnavailable("ray is not installed (pip install 'dmlsearch[ray]')")
        self.port = free_port()
        self._start_node(
            [
                "--head",
                "--port",
                str(self.port),
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
                "--temp-dir",
                str(self.root / "ray"),
                "--ray-client-server-port",
                str(free_port()),
            ]
        )
        for _ in range(workers):
            self.add_worker()

    def add_worker(self) -> None:
        """Join one more node (its own ``ray start --address``) and wait until the cluster counts it."""
        self._start_node(["--address", self.address])

    def remove_worker(self) -> None:
        """Kill the last worker node's processes at once (SIGKILL), as a machine that goes away."""
        node = self.nodes.pop()
        _stop_group(node, grace=0)

    def node_processes(self, node: int) -> list[tuple[int, str]]:
        """(pid, command line) of the processes of node ``node`` (0 = the head)."""
        members = []
        for pid in _tree(self.nodes[node].pid):
            with contextlib.suppress(OSError):
                members.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()))
        return members

    def _start_node(self, arguments: list[str]) -> None:
        log = (self.root / f"node{len(self.nodes)}.log").open("ab")
        pinned = (
            ["taskset", "--cpu-list", str(len(self.nodes) % (os.cpu_count() or 1))] if self.pin_cores else []
        )
        with log:
            node = subprocess.Popen(
                [
                    *pinned,
                    RAY_COMMAND,
                    "start",
                    "--block",
                    "--num-cpus",
                    str(self.cpus_per_node),
                    "--node-ip-address",
                    "127.0.0.1",
                    *arguments,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.nodes.append(node)
        self._wait_for_nodes(len(self.nodes))

    def _wait_for_nodes(self, count: int) -> None:
        probe = (
            "import ray, sys, time\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            f"deadline = time.monotonic() + {RAY_START_TIMEOUT_S}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
            "    assert time.monotonic() < deadline, 'nodes missing'\n"
            "    time.sleep(0.5)\n"
        )
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while True:
            if self.nodes[-1].poll() is not None:
                raise RayClusterUnavailable(
                    f"ray start exited with {self.nodes[-1].returncode}: {self.log_tail()}"
                )
            done = subprocess.run(
                [sys.executable, "-c", probe],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=RAY_START_TIMEOUT_S,
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RayClusterUnavailable(f"the Ray nodes did not come up: {done.stderr[-1000:]}")
            time.sleep(1)

    def log_tail(self) -> str:
        return " | ".join(
            log.read_text(errors="replace")[-800:] for log in sorted(self.root.glob("node*.log"))
        )

    def stop(self) -> None:
        """SIGTERM to each node's process group, SIGKILL after a grace period; returns when none is left."""
        while self.nodes:
            _stop_group(self.nodes.pop(), grace=RAY_STOP_GRACE_S)


def _tree(root: int) -> set[int]:
    """``root``'s process group and every descendant of its members: Ray's worker processes start sessions
    of their own, outside the group of the node that spawned them."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree = set(group_members(root)) | {root}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def _stop_group(leader: subprocess.Popen, grace: float) -> None:
    """Stop a node: its process group and its workers (``_tree``), SIGTERM then SIGKILL (at once without
    ``grace``); returns when none of them is left."""
    group = leader.pid  # start_new_session: the group's id is the leader's pid
    processes = _tree(group)
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace else (signal.SIGKILL,):
        processes |= _tree(group) if group_alive(group, leader) else set()
        for pid in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace or RAY_STOP_GRACE_S)
        while _any_alive(processes, group, leader) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _any_alive(processes, group, leader):
            return


def _any_alive(processes: set[int], group: int, leader: subprocess.Popen) -> bool:
    return group_alive(group, leader) or any(_state(pid) not in ("Z", None) for pid in processes)


def group_alive(group: int, leader: subprocess.Popen) -> bool:
    leader.poll()  # reap the leader, or it stays a zombie member of the group
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    # Members that exited but wait for their parent to reap them are gone for our purpose.
    return any(_state(pid) not in ("Z", None) for pid in group_members(group))


def group_members(group: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                members.append(int(stat.parent.name))
    return members


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
