"""Serving commands: the HTTP API, the Streamlit UI and the end-to-end demo."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from app.settings import Settings
from cli.common import fail, reports_errors
from cli.index_commands import build_index
from cli.model_commands import export
from cli.settings_flags import settings_flags
from foundation import defaults

commands = typer.Typer()


# Shorter names for some generated flags: what README, docker/ and tests have always used.
SERVE_FLAG_ALIASES = {
    "index_path": ("--index",),
    "model_path": ("--model",),
    "rate_limit_per_second": ("--rate-limit",),
    "rate_limit_burst": ("--rate-burst",),
    "cors_origins": ("--cors-origin",),
    "trusted_proxies": ("--trusted-proxy",),
}


@commands.command()
@settings_flags(Settings, SERVE_FLAG_ALIASES)
@reports_errors  # nothing to serve (no index at the path, say): error: the reason, exit 2
def serve(
    settings: Settings,
    host: str = defaults.API_HOST,
    port: int = defaults.API_PORT,
) -> None:
    """Serve the HTTP API (FastAPI under uvicorn). Flags override DMLSEARCH_* environment variables.

    Every field of app/settings.py is a flag (generated: see cli/settings_flags.py).
    """
    from app.api import create_app
    from app.server import run_server

    # Concurrency comes from parallel requests, so each FAISS search runs on one OpenMP thread: on a
    # busy CPU, OpenMP's per-call thread start-up made a 78-item flat search take ~30 ms instead of
    # ~0.1 ms. Must be set before FAISS loads; an explicit OMP_NUM_THREADS in the environment wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # SIGTERM and SIGINT alike: stop accepting, drain for shutdown_grace_seconds, exit 0 (app/server.py).
    run_server(
        create_app(settings),
        settings,
        host=host,
        port=port,
        # uvicorn's own default believes X-Forwarded-For from 127.0.0.1: any local process could then
        # claim a fresh address per request and slip past the rate limit.
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=settings.trusted_proxies or None,
    )


@commands.command()
def ui(
    api_url: Annotated[str, typer.Option(help="Base URL of the dmlsearch HTTP API.")] = defaults.API_URL,
    port: int = defaults.UI_PORT,
    host: str = defaults.API_HOST,
) -> None:
    """Start the Streamlit page (a client of the HTTP API)."""
    spec = importlib.util.find_spec("app.ui")
    assert spec is not None and spec.origin is not None  # app/ui.py is part of the package
    page = spec.origin
    env = {**os.environ, "DMLSEARCH_API_URL": api_url}
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(page),
        "--server.port",
        str(port),
        "--server.address",
        host,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",  # no developer menu or "Deploy" button for people using the search page
        # The upload box states the API's image limit (same DMLSEARCH_ environment), not Streamlit's 200 MB.
        "--server.maxUploadSize",
        str(math.ceil(Settings().max_upload_bytes / 2**20)),
    ]
    # Become Streamlit rather than wait for it: a signal for this process (demo stopping its children,
    # a supervisor) then reaches the server itself instead of orphaning it.
    os.execve(sys.executable, command, env)


@commands.command("demo-gallery")
def demo_gallery(
    out: Annotated[Path, typer.Argument(help="Folder to create.")] = defaults.DEMO_DIR / "gallery",
) -> None:
    """Assemble the demo gallery from permissively licensed photos in scikit-image and scikit-learn."""
    from engine.gallery.demo import write_demo_gallery

    count = write_demo_gallery(out)
    typer.echo(f"wrote {count} images to {out} (licences in {out / 'LICENSES.md'})")


def _wait_until_ready(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise fail(f"server exited with code {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise fail(f"{url} did not answer within {timeout_s:.0f} s")


@commands.command()
def demo(
    workdir: Annotated[
        Path, typer.Option(help="Where the demo's own model, gallery and index go (never your index).")
    ] = defaults.DEMO_DIR,
    api_port: int = defaults.API_PORT,
    ui_port: int = defaults.UI_PORT,
    host: str = defaults.API_HOST,
    serve_after: Annotated[
        bool, typer.Option("--serve/--no-serve", help="Start the API and UI at the end.")
    ] = True,
) -> None:
    """The main job end to end: export the pretrained embedder, index the demo gallery, serve API + UI."""
    model = workdir / "model" / "model.onnx"
    gallery = workdir / "gallery"
    index_dir = workdir / "index"
    export(out=model)
    if not gallery.is_dir():
        demo_gallery(out=gallery)
    build_index(gallery=gallery, out=index_dir, model=model)
    if not serve_after:
        return
    cli = [sys.executable, "-m", "cli.main"]
    serve_command = [*cli, "serve", "--index", str(index_dir), "--host", host, "--port", str(api_port)]
    api_url = f"http://{host}:{api_port}"
    children: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        api = subprocess.Popen(serve_command)  # the index carries its model
        children.append(api)
        _wait_until_ready(f"{api_url}/readyz", api)
        ui_process = subprocess.Popen(
            [*cli, "ui", "--api-url", api_url, "--port", str(ui_port), "--host", host]
        )
        children.append(ui_process)
        _wait_until_ready(f"http://{host}:{ui_port}/_stcore/health", ui_process)
        typer.secho(f"API: {api_url}  (OpenAPI docs at {api_url}/docs)", fg=typer.colors.GREEN)
        typer.secho(f"UI:  http://{host}:{ui_port}", fg=typer.colors.GREEN)
        typer.echo("Press Ctrl-C to stop.")
        api.wait()
    except KeyboardInterrupt:
        pass
    finally:
        _stop_children(children[::-1])  # the UI first: it is the API's client


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (systemd, docker stop, Kubernetes) stops the demo as Ctrl-C does


def _stop_children(children: list[subprocess.Popen]) -> None:
    """SIGTERM every child, give each its shutdown grace (plus start-up slack), then SIGKILL what is left."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    for process in children:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + Settings().shutdown_grace_seconds + 10.0
    for process in children:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            typer.echo(f"process {process.pid} did not stop in time: killing it", err=True)
            process.kill()
            process.wait()
