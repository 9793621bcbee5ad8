"""Index commands: build an index from a gallery folder and query it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cli.common import DEFAULT_MODEL, fail

commands = typer.Typer()


@commands.command("build-index")
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


@commands.command()
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
