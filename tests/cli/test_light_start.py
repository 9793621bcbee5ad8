"""`dmlsearch` starts light: parsing its command line (and `--help`) loads neither the server (FastAPI,
Starlette, uvicorn), the decoders (Pillow, libheif) nor a model runtime (onnxruntime, torch); each
command loads what it runs. Every `dmlsearch` process pays its imports, scripts and tests run many."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What only some commands need: `serve` the server, the image commands the decoders and a model runtime.
LOADED_BY_COMMANDS = ("fastapi", "starlette", "uvicorn", "PIL", "pillow_heif", "onnxruntime", "torch")


def test_the_command_line_loads_no_server_decoder_or_model_runtime() -> None:
    code = (
        "import sys\n"
        "from cli.main import app\n"
        "import typer.main\n"
        "typer.main.get_command(app)\n"  # every command's flags built, as `dmlsearch --help` builds them
        f"print(' '.join(m for m in {LOADED_BY_COMMANDS!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == []
