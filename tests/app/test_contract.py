"""The API keeps its own OpenAPI contract: schemathesis (``--checks all``) against a real server, with the
write endpoints under a key, finds no failure. Bounded examples keep it to a couple of minutes in CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import API_KEY, Served, uvicorn_server

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMATHESIS = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
# Examples per operation, and a fixed seed: the same requests on every run.
MAX_EXAMPLES = 25
SEED = 24
REQUEST_SECONDS = 60


@pytest.mark.skipif(SCHEMATHESIS is None, reason="schemathesis is not installed (pip install -e '.[dev]')")
@pytest.mark.server
def test_the_api_keeps_its_openapi_contract(served_module: Served, tmp_path: Path) -> None:
    args = ["--index", str(served_module.index), "--model", str(served_module.model), "--rate-limit", "0"]
    env = {"DMLSEARCH_API_KEY": API_KEY}
    with uvicorn_server(args, env) as url:
        run = subprocess.run(
            [
                str(SCHEMATHESIS),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "all",
                "--header",
                f"X-API-Key: {API_KEY}",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                str(SEED),
                "--generation-deterministic",
                "--request-timeout",
                str(REQUEST_SECONDS),
                # A contract, not a benchmark (speed is measured in bench/): a 64-image batch took 18 s
                # on the loaded 2-core test machine, past schemathesis's default of 10 s.
                "--max-response-time",
                str(REQUEST_SECONDS),
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
            # The hooks module is found from the repository root (tests/ is not an installed package).
            env={
                **os.environ,
                "SCHEMATHESIS_HOOKS": "tests.app.schemathesis_hooks",
                "CONTRACT_INDEX_PATH": str(served_module.index),  # what a positive reload case names
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            },
        )
    (tmp_path / "report.txt").write_text(run.stdout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
