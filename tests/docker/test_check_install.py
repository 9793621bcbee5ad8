"""docker/check_install.py: the images built with podman on a local base, and run for real.

The full build-and-run check takes minutes (debootstrap, two image builds, compose; see docker/README.md),
so it runs only when asked: DMLSEARCH_IMAGE_TESTS=1 (serving image, API, UI, compose's api and ui), or
=full (also the 7 GB train image and compose's setup step). `.ci/run` sets 1 and installs podman from apt.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "check_install.py"


def check_install() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_install", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_sees_the_hosts_pip_settings_and_the_paths_they_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "ca.crt"
    bundle.write_text("certificate")
    wheels = tmp_path / "wheels"
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    wheels.mkdir()
    config = tmp_path / "pip.conf"
    config.write_text(
        f"[global]\ncert = /not/this/one.crt\nextra-index-url = file://{tmp_path}/pypi/simple\n"
        "[install]\nno-compile = yes\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("PIP_CERT", str(bundle))  # a variable beats the files, as in pip
    monkeypatch.setenv("PIP_FIND_LINKS", f"{wheels} https://example.org/wheels")  # a variable counts too
    monkeypatch.setenv("PIP_TIMEOUT", "99")

    text, paths = check_install().host_pip_config()

    # The file pip in the build reads holds every effective setting, from files and variables alike.
    assert "[global]" in text
    assert f"cert = {bundle}" in text
    assert f"find-links = {wheels} https://example.org/wheels" in text
    assert "timeout = 99" in text
    assert "[install]\nno-compile = yes" in text
    # A file:// index is mounted with its files beside simple/; URLs are not paths.
    assert {bundle, wheels, tmp_path / "pypi"} <= set(paths)
    assert all(path.exists() for path in paths)


def test_a_podman_that_cannot_run_is_a_reason_to_skip_not_a_failure(tmp_path: Path) -> None:
    """podman installed but unable to run here (no storage, no runtime): exit code 3 and the reason, the
    way the image test skips; nothing of ours was built, so nothing of ours failed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    podman = bin_dir / "podman"
    podman.write_text("#!/bin/sh\necho 'Error: cannot set up the storage driver' >&2\nexit 125\n")
    podman.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    command = [sys.executable, str(SCRIPT), "--compose", "none"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("cannot run the image check here: podman info") and "storage driver" in last


IMAGE_TESTS = os.environ.get("DMLSEARCH_IMAGE_TESTS", "")


@pytest.mark.container
@pytest.mark.skipif(
    IMAGE_TESTS not in {"1", "full"},
    reason="minutes long: opt in with DMLSEARCH_IMAGE_TESTS=1 (.ci/run sets it); =full adds the train image",
)
def test_images_build_serve_search_and_stop_cleanly() -> None:
    compose = "full" if IMAGE_TESTS == "full" else "serving"
    command = [sys.executable, str(SCRIPT), "--compose", compose]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "OK"
    for check in ("API", "UI", "compose api", "compose ui"):
        assert f"{check} exit code after SIGTERM: 0" in lines, check
    assert "torch in the serving image: no" in lines
    assert int(next(line for line in lines if line.startswith("API search results:")).split(":")[1]) > 0
    if compose == "full":
        assert "compose setup exit code: 0" in lines
