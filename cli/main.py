"""``dmlsearch``: export models, build indexes, query them and serve them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Image retrieval with deep-metric-learning embeddings.", no_args_is_help=True)

DEFAULT_MODEL = Path("artifacts/model/model.onnx")


def fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=2)


@app.command()
def export(
    out: Annotated[
        Path, typer.Option(help="Where to write model.onnx (model.json goes beside it).")
    ] = DEFAULT_MODEL,
    backbone: Annotated[str, typer.Option(help="Backbone name.")] = "efficientnet_lite0",
) -> None:
    """Export the pretrained backbone (global-average-pooled features, L2-normalised) to ONNX."""
    from training.backbone import BACKBONES, create_backbone
    from training.export import export_onnx
    from training.model import EmbeddingModel

    if backbone not in BACKBONES:
        raise fail(f"unknown backbone {backbone!r}; choose one of {sorted(BACKBONES)}")
    model = EmbeddingModel(create_backbone(backbone))
    card = export_onnx(model, out, preprocessing=BACKBONES[backbone].preprocessing, backbone=backbone)
    typer.echo(f"wrote {out} ({card.embedding_dim}-d, fingerprint {card.fingerprint[:12]})")


@app.command("build-index")
def build_index(
    gallery: Annotated[Path, typer.Argument(help="Folder of images; sub-folder names become labels.")],
    out: Annotated[Path, typer.Option(help="Index directory to write.")],
    model: Annotated[Path, typer.Option(help="Exported model.onnx.")] = DEFAULT_MODEL,
    batch_size: Annotated[int, typer.Option(min=1, max=1024)] = 32,
    threads: Annotated[int, typer.Option(min=0, help="onnxruntime threads (0 = all cores).")] = 0,
) -> None:
    """Embed every image under GALLERY and write a FAISS index directory."""
    from engine.embedder import Embedder
    from engine.indexing import build_index as run_build

    if not gallery.is_dir():
        raise fail(f"gallery folder {gallery} does not exist")
    try:
        embedder = Embedder(model, threads=threads)
        report = run_build(gallery, embedder, out, batch_size=batch_size)
    except (FileNotFoundError, ValueError) as err:
        raise fail(str(err)) from None
    typer.echo(f"indexed {report.indexed} images into {out}")
    if report.duplicates:
        typer.echo(f"{len(report.duplicates)} duplicate files indexed once")
    if report.skipped:
        typer.secho(f"skipped {len(report.skipped)} unreadable files:", fg=typer.colors.YELLOW, err=True)
        for path, reason in report.skipped:
            typer.echo(f"  {path}: {reason}", err=True)


@app.command()
def query(
    image: Annotated[Path, typer.Argument(help="Query image file.")],
    index: Annotated[Path, typer.Option(help="Index directory.")],
    model: Annotated[Path, typer.Option(help="Exported model.onnx.")] = DEFAULT_MODEL,
    k: Annotated[int, typer.Option("-k", "--k", min=1, max=1000, help="How many results.")] = 10,
    min_score: Annotated[float, typer.Option(min=-1.0, max=1.0)] = -1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Print the K gallery images most similar to IMAGE with their cosine scores."""
    from dataclasses import asdict

    from engine.images import ImageDecodeError
    from engine.search import SearchService
    from index.gallery import IndexMismatchError

    if not image.is_file():
        raise fail(f"query image {image} does not exist")
    try:
        service = SearchService.open(model, index)
        response = service.search(image.read_bytes(), k=k, min_score=min_score)
    except ImageDecodeError as err:
        raise fail(f"{image}: {err.message}") from None
    except (FileNotFoundError, IndexMismatchError, ValueError) as err:
        raise fail(str(err)) from None
    if as_json:
        payload = {
            "results": [asdict(result) for result in response.results],
            "took_ms": response.took_ms,
            "model_fingerprint": response.model_fingerprint,
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    typer.echo(f"{'rank':>4}  {'score':>7}  {'label':<24} path")
    for result in response.results:
        typer.echo(f"{result.rank:>4}  {result.score:7.4f}  {result.label or '-':<24} {result.path}")


@app.command()
def serve(
    index: Annotated[Path, typer.Option(help="Index directory.")],
    model: Annotated[Path, typer.Option(help="Exported model.onnx.")] = DEFAULT_MODEL,
    host: str = "127.0.0.1",
    port: int = 8000,
    threads: Annotated[int, typer.Option(min=0)] = 0,
) -> None:
    """Serve the HTTP API (FastAPI under uvicorn)."""
    import uvicorn

    from app.api import create_app
    from app.settings import Settings

    settings = Settings(index_path=index, model_path=model, threads=threads)
    uvicorn.run(create_app(settings), host=host, port=port)


@app.command()
def ui(
    api_url: Annotated[
        str, typer.Option(help="Base URL of the dmlsearch HTTP API.")
    ] = "http://127.0.0.1:8000",
    port: int = 8501,
    host: str = "127.0.0.1",
) -> None:
    """Start the Streamlit page (a client of the HTTP API)."""
    page = importlib.util.find_spec("app.ui").origin
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
    ]
    raise typer.Exit(subprocess.call(command, env=env))


@app.command("demo-gallery")
def demo_gallery(
    out: Annotated[Path, typer.Argument(help="Folder to create.")] = Path("artifacts/gallery"),
) -> None:
    """Assemble the demo gallery from permissively licensed photos in scikit-image and scikit-learn."""
    from engine.demo_gallery import write_demo_gallery

    count = write_demo_gallery(out)
    typer.echo(f"wrote {count} images to {out} (licences in {out / 'LICENSES.md'})")


def _wait_until_ready(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import time

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


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the model, gallery and index go.")] = Path("artifacts"),
    api_port: int = 8000,
    ui_port: int = 8501,
    host: str = "127.0.0.1",
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
    api = subprocess.Popen(
        [
            *cli,
            "serve",
            "--index",
            str(index_dir),
            "--model",
            str(model),
            "--host",
            host,
            "--port",
            str(api_port),
        ]
    )
    api_url = f"http://{host}:{api_port}"
    ui_process = None
    try:
        _wait_until_ready(f"{api_url}/readyz", api)
        ui_process = subprocess.Popen(
            [*cli, "ui", "--api-url", api_url, "--port", str(ui_port), "--host", host]
        )
        _wait_until_ready(f"http://{host}:{ui_port}/_stcore/health", ui_process)
        typer.secho(f"API: {api_url}  (OpenAPI docs at {api_url}/docs)", fg=typer.colors.GREEN)
        typer.secho(f"UI:  http://{host}:{ui_port}", fg=typer.colors.GREEN)
        typer.echo("Press Ctrl-C to stop.")
        api.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for process in (ui_process, api):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=10)


if __name__ == "__main__":
    app()
