"""docker/check_install.py reads the real Dockerfiles: each step is run or skipped for a stated reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("dockerfile", "extras"), [("Dockerfile", "cpu,milvus"), ("Dockerfile.gpu", "gpu,milvus-client")]
)
def test_dry_run_lists_the_image_install_steps(dockerfile: str, extras: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "docker/check_install.py",
            f"docker/{dockerfile}",
            "--dry-run",
            "--root",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    runs = [line for line in result.stdout.splitlines() if line.startswith("RUN ")]
    assert any(f'pip install ".[{extras}]"' in run for run in runs)
    assert any("pip install --no-deps ." in run for run in runs)
    # Container paths land under the emulated root, never on the host's /data or /opt.
    assert all(" /data" not in run and " /opt" not in run for run in runs)
    skipped = result.stdout.splitlines()[-1]
    assert "skipped: apt-get" in skipped
    assert "useradd" in skipped and "chown" in skipped
    # The index carries its model: a fixed model path would be refused once another model is promoted.
    lines = (REPO / "docker" / dockerfile).read_text().splitlines()
    instructions = [line for line in lines if not line.startswith("#")]
    assert not any("DMLSEARCH_MODEL_PATH" in line for line in instructions)


def test_unknown_instructions_are_refused(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim\nHEALTHCHECK CMD true\n")
    result = subprocess.run(
        [sys.executable, "docker/check_install.py", str(dockerfile), "--dry-run", "--root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "unsupported instruction HEALTHCHECK" in result.stderr
