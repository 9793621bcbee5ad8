"""The README's "Using it" section, run: every shell command of its bash blocks, in order, against a tiny
generated gallery, so the README cannot drift from the code.

Commands run as written, in a fresh working directory, with these changes only (``_adapt``), each forced by
the test machine rather than by the commands:
- ``PHOTOS_DIR`` is the generated gallery, which has the labels and folders the examples filter on;
- ports: the servers listen on free ports (``--port``, and the URLs follow), not 8000 and 8501, which other
  processes on a shared machine may hold;
- ``make setup`` is dry-run (``make -n``): it would install the virtualenv these tests already run in
  (``source .venv/bin/activate`` then activates that one, linked into the working directory);
- ``dmlsearch serve`` and ``dmlsearch ui``, which run until stopped, start in the background; the commands
  after them run once they answer (``/readyz``, Streamlit's ``/_stcore/health``), and they are stopped with
  SIGTERM at the end, which each must answer with exit 0.
``curl`` runs with ``--fail-with-body`` (from a ``.curlrc``), so an HTTP error fails the test too.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.lib.images import make_image
from bench.lib.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
SECTION = "Using it"
SERVERS = {"dmlsearch serve": "/readyz", "dmlsearch ui": "/_stcore/health"}


def section_commands(readme: str, title: str) -> list[str]:
    """The shell commands of the bash blocks of the README section ``title`` (continued lines joined)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", readme, flags=re.M | re.S)
    assert match, f"the README has no section {title!r}"
    commands: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", match.group(1), flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def _gallery(root: Path) -> Path:
    """Photos in label folders, some below ``2024/`` (the examples filter on cats, dogs and 2024/)."""
    photos = root / "photos"
    for number, folder in enumerate(["2024/cats", "2024/dogs", "camera/hummer", "trips/birds"]):
        (photos / folder).mkdir(parents=True)
        for copy in range(3):
            make_image(10 * number + copy, size=(96, 80)).save(photos / folder / f"IMG_{copy}.jpg")
    return photos


def _adapt(command: str, photos: Path, ports: dict[str, int]) -> str:
    command = command.replace("PHOTOS_DIR", shlex.quote(str(photos)))
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{ports['api']}")
    command = command.replace("make setup", f"make --no-print-directory -n -C {shlex.quote(str(ROOT))} setup")
    if command.startswith("dmlsearch serve"):
        command = command.replace("dmlsearch serve", f"dmlsearch serve --port {ports['api']}", 1)
    if command.startswith("dmlsearch ui"):
        command = command.replace("dmlsearch ui", f"dmlsearch ui --port {ports['ui']}", 1)
    return command


def _wait_until_ready(process: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{url}: the server exited with {process.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s")


def test_the_section_is_found_and_holds_only_commands_this_test_knows() -> None:
    commands = section_commands((ROOT / "README.md").read_text(), SECTION)
    assert len(commands) >= 8
    assert {command.split()[0] for command in commands} <= {"make", "dmlsearch", "curl"}
    assert [c for c in commands if c.startswith(tuple(SERVERS))], "no server started: nothing to query"


@pytest.mark.slow
def test_every_command_of_using_it_runs(tmp_path: Path) -> None:
    photos = _gallery(tmp_path)
    for name, seed in [("photo.jpg", 1), ("photo2.jpg", 21), ("query.jpg", 22)]:
        make_image(seed, size=(120, 90)).save(tmp_path / name)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # `source .venv/bin/activate`: the venv running the tests
    (tmp_path / ".curlrc").write_text("fail-with-body\nsilent\nshow-error\n")
    # Each command runs in a shell of its own: the README's `source .venv/bin/activate` lasts for the
    # reader's whole session, so every command gets what it sets (the tests may run without it, as `make`).
    activated = {
        "VIRTUAL_ENV": sys.prefix,
        "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    env = {**os.environ, **activated, "CURL_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    ports = {"api": free_port(), "ui": free_port()}
    servers: list[tuple[str, subprocess.Popen]] = []
    try:
        for written in section_commands((ROOT / "README.md").read_text(), SECTION):
            command = _adapt(written, photos, ports)
            server = next((path for prefix, path in SERVERS.items() if command.startswith(prefix)), None)
            if server is not None:
                process = subprocess.Popen(
                    ["bash", "-c", f"exec {command}"],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                servers.append((written, process))
                port = ports["ui" if command.startswith("dmlsearch ui") else "api"]
                _wait_until_ready(process, f"http://127.0.0.1:{port}{server}")
                continue
            result = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            assert result.returncode == 0, f"{written}\n{result.stdout}\n{result.stderr}"
    finally:
        for written, process in reversed(servers):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise AssertionError(f"{written}: still running 30 s after SIGTERM") from None
            assert code == 0, f"{written}: exit {code} after SIGTERM"
