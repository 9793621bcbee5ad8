"""A local Ray cluster for a test (the cluster itself: ``bench.lib.cluster``)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.lib.cluster import RayCluster, RayClusterUnavailable


@contextmanager
def running_ray_cluster(cpus_per_node: int = 1) -> Iterator[RayCluster]:
    """A Ray head and one worker node on this machine, stopped and its folder removed at the end; the test
    skips, saying why, only where ray is not installed or the cluster cannot start."""
    # A short folder: Ray's socket paths must stay within the 107 bytes of a Unix socket's name.
    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="dmlray", dir="/tmp")), cpus_per_node)
    try:
        cluster.start()
    except (RayClusterUnavailable, subprocess.TimeoutExpired) as err:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
        pytest.skip(f"a local Ray cluster cannot start here: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
