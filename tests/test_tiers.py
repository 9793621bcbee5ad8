"""The tiers of the suite (tests/tiers.py): which processes put a test in the slow tier, the guard that
fails a fast-tier test which starts one (through a fixture, a helper or its own Popen), and the marking
from fixtures. These tests are in the fast tier themselves: every process they would start is refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.lib.cluster import RAY_COMMAND, RayCluster
from bench.lib.servers import free_port, start_server
from tests.support.milvus_server import MILVUS_LAUNCHER, MilvusServerProcess
from tests.tiers import FAST_TIER, GUARD, SlowTierRequired, process_kind

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        ([PYTHON, "-m", "cli.main", "serve", "--port", "8000", "--index", "x"], "server"),
        ([".venv/bin/dmlsearch", "ui", "--api-url", "http://127.0.0.1:8000"], "server"),
        ([".venv/bin/dmlsearch", "--verbose", "demo"], "server"),
        ([PYTHON, "-m", "cli.main", "watch", "gallery", "--index", "x"], "server"),
        (["bash", "-c", "exec dmlsearch serve --index artifacts/index"], "server"),
        ([PYTHON, "-m", "streamlit", "run", "app/ui.py"], "server"),
        ([PYTHON, "-c", MILVUS_LAUNCHER, "--data", "d", "--proxy-port", "1"], "server"),
        (["make", "--no-print-directory", "-C", "/repo", "demo", "BIN=x"], "server"),
        ([RAY_COMMAND, "start", "--block", "--head"], "cluster"),
        (["/site-packages/ray/core/src/ray/gcs/gcs_server", "--gcs_server_port=0"], "cluster"),
        ([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "worker.py"], "cluster"),
        (["/usr/bin/chromium", "--headless"], "browser"),
        (["podman", "build", "-f", "docker/Dockerfile", "."], "container"),
        ("podman-compose -f docker/compose.yaml up", "container"),
        ([PYTHON, "-m", "cli.main", "build-index", "gallery", "--model", "m.onnx"], None),
        ([PYTHON, "-m", "cli.main", "query", "server.jpg", "--index", "serve"], None),
        ([PYTHON, "-m", "cli.main", "demo", "--workdir", "w", "--no-serve"], None),
        ([PYTHON, "docker/check_install.py"], None),
        (["/site-packages/milvus_lite/lib/milvus", "/tmp/x.db"], None),  # Milvus Lite: embedded
        ([PYTHON, "-c", "print('ray start')"], None),
        (["make", "test"], None),
    ],
)
def test_the_kind_of_a_process_comes_from_its_command_line(command: object, kind: str | None) -> None:
    assert process_kind(command) == kind


def _refused(start: object) -> str:
    """What the guard says when ``start()``, run in this fast-tier test, starts a process."""
    with pytest.raises(SlowTierRequired) as refusal:
        start()  # type: ignore[operator]
    assert GUARD.take() == [refusal.value.msg]  # kept, then taken here: this test does not fail for it
    return refusal.value.msg


def test_a_fast_test_that_starts_a_server_fails_before_the_process_starts(tmp_path: Path) -> None:
    message = _refused(lambda: start_server(["--index", str(tmp_path / "index")]))
    assert "test_tiers.py::test_a_fast_test_that_starts_a_server" in message
    assert "cli.main serve --port" in message and "@pytest.mark.server" in message


def test_the_helpers_clusters_and_milvus_servers_are_refused_too(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("milvus")
    assert "@pytest.mark.cluster" in _refused(lambda: RayCluster(tmp_path / "ray").start())
    milvus = MilvusServerProcess(tmp_path / "milvus", free_port())
    assert "@pytest.mark.server" in _refused(milvus.start)
    assert "@pytest.mark.browser" in _refused(lambda: subprocess.Popen(["chromium", "--headless"]))


def test_other_processes_are_allowed() -> None:
    done = subprocess.run([PYTHON, "-c", "print('dmlsearch serve')"], capture_output=True, text=True)
    assert done.returncode == 0 and GUARD.take() == []


def test_markers_come_from_fixtures_and_the_guard_holds_the_rest(tmp_path: Path) -> None:
    """A small suite run with this plugin: the tests that use a declared fixture, even through another one,
    or carry a kind's marker are deselected by the fast tier; a fast-tier test that starts a server anyway,
    through an undeclared fixture, in a thread, or catching the refusal, fails."""
    # `python -c pass dmlsearch serve` reads as a server's command line, and exits at once.
    (tmp_path / "test_suite.py").write_text(
        textwrap.dedent(
            f"""
            import subprocess, threading
            import pytest
            from tests.tiers import starts

            SERVER = [{PYTHON!r}, "-c", "pass", "dmlsearch", "serve"]

            @pytest.fixture
            @starts("server")
            def declared():
                subprocess.run(SERVER, check=True)

            @pytest.fixture
            def through(declared):
                return "through"

            @pytest.fixture
            def undeclared():
                subprocess.run(SERVER, check=True)

            def test_declared_fixture(through):
                pass

            @pytest.mark.parametrize("engine", ["lite", pytest.param("server", marks=pytest.mark.server)])
            def test_marked_parameter(engine):
                if engine == "server":
                    subprocess.run(SERVER, check=True)

            @pytest.mark.cluster
            def test_marked():
                pass

            def test_undeclared_fixture(undeclared):
                pass

            def test_in_a_thread():
                thread = threading.Thread(target=lambda: subprocess.run(SERVER))
                thread.start()
                thread.join()

            def test_caught():
                try:
                    subprocess.run(SERVER)
                except BaseException:
                    pass

            def test_plain():
                subprocess.run([{PYTHON!r}, "-c", "pass"], check=True)
            """
        )
    )

    def run(*args: str) -> str:
        # Not the plugins pyproject.toml leaves out (its addopts do not reach tmp_path): ~1 s to load.
        plugins = ("tests.tiers", "no:cacheprovider", "no:schemathesis", "no:hypothesispytest")
        command = [PYTHON, "-m", "pytest", *(f"-p{plugin}" for plugin in plugins), "-q", "-rA", *args]
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        return done.stdout + done.stderr

    fast = run("-m", FAST_TIER, "--strict-markers")
    assert "3 deselected" in fast, fast
    for test in ("test_undeclared_fixture", "test_in_a_thread", "test_caught"):
        assert f"ERROR test_suite.py::{test}" in fast, fast
        assert f"test_suite.py::{test} starts a server process" in fast, fast
    assert "PASSED test_suite.py::test_marked_parameter[lite]" in fast, fast
    assert "PASSED test_suite.py::test_plain" in fast, fast

    slow = run("-m", "slow")  # the slow tier alone: its tests may start what they need
    assert "3 passed, 5 deselected" in slow, slow
