"""What the README says of ``make demo`` on SIGTERM: the demo stops cleanly and exits 0, and make, as for any
signal, then reports it and exits with 128 + the signal. A stub stands in for ``dmlsearch demo`` (its own
exit 0 is tested in tests/app/test_fault_signals.py); the Makefile is the real one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/bin/sh
trap 'echo "demo stopped"; exit 0' TERM INT
echo "demo ready"
while :; do sleep 0.1; done
"""


@pytest.mark.server
def test_sigterm_to_make_demo_stops_the_demo_which_exits_0_and_make_exits_143(tmp_path: Path) -> None:
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    (venv_bin / "dmlsearch").write_text(STUB)
    (venv_bin / "dmlsearch").chmod(0o755)
    stamp = tmp_path / "installed"  # newer than pyproject.toml: setup has nothing to do
    stamp.touch()
    make = subprocess.Popen(
        ["make", "--no-print-directory", "-C", str(ROOT), "demo", f"BIN={venv_bin}", f"STAMP={stamp}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    try:
        assert make.stdout.readline().strip().endswith("dmlsearch demo")  # make echoes the recipe
        assert make.stdout.readline().strip() == "demo ready"
        time.sleep(0.2)
        make.send_signal(signal.SIGTERM)  # what docker stop or systemd send to the process they started
        output = make.stdout.read()
        assert make.wait(timeout=20) == -signal.SIGTERM, output  # a shell reports it as 128 + 15 = 143
    finally:
        if make.poll() is None:
            make.kill()
    assert "demo stopped" in output
