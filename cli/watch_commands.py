"""``dmlsearch watch``: keep an index in sync with a gallery folder as it changes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_duplicate_files, echo_moves, fail, model_for_index, reports_errors
from engine.build.changes import DEFAULT_MAX_BATCH, DEFAULT_SETTLE_SECONDS
from foundation import defaults

commands = typer.Typer()


@commands.command()
@reports_errors
def watch(
    gallery: Annotated[Path, typer.Argument(help="Folder of images; sub-folder names become labels.")],
    index: Annotated[Path, typer.Option(help="Index directory to keep in sync (built first if absent).")],
    model: Annotated[
        Path | None,
        typer.Option(
            help=f"Exported model.onnx (default: the one INDEX carries, else {defaults.MODEL_PATH})."
        ),
    ] = None,
    settle: Annotated[
        float,
        typer.Option(min=0.05, help="Seconds a file must stay unchanged (size and mtime) before indexing."),
    ] = DEFAULT_SETTLE_SECONDS,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Most files applied in one batch.")
    ] = DEFAULT_MAX_BATCH,
    batch_size: Annotated[
        int, typer.Option(min=1, max=1024, help="Images embedded at once.")
    ] = defaults.BATCH_SIZE,
    threads: Annotated[int, typer.Option(min=0, help="onnxruntime threads (0 = all cores).")] = 0,
) -> None:
    """Catch INDEX up with GALLERY (as build-index does), then apply every addition, change, rename, move and
    deletion in debounced batches until interrupted. A `dmlsearch serve` on INDEX picks the changes up.

    When another index takes the INDEX path (a link repointed to a promoted index, or build-index with a
    new model), the watcher switches to it and to its model, and catches it up."""
    from engine.build.report import BuildReport
    from engine.build.watching import GalleryWatcher
    from engine.model.embedder import Embedder
    from foundation.stopping import StopRequested, stop_on_signals

    if not gallery.is_dir():
        raise fail(f"gallery folder {gallery} does not exist")

    def report(batch: list[Path], result: BuildReport) -> None:
        what = f"{len(batch)} changed paths" if batch else "catch-up"
        typer.echo(
            f"{what}: {result.indexed} indexed, {result.moved} moved, {result.removed} removed, "
            f"{result.unchanged} unchanged, {len(result.skipped)} skipped",
        )
        echo_moves(result.moves)
        for path, reason in result.skipped:
            typer.secho(f"  skipped {path}: {reason}", fg=typer.colors.YELLOW, err=True)
        echo_duplicate_files(result.duplicates)
        if not batch:
            typer.echo(f"watching {gallery} (Ctrl-C stops)")

    def follow(previous_model: str, model: str, replaced: bool) -> None:
        if not replaced:
            typer.echo(f"{index} was saved by another process (one writer per index is safest): catching up")
            return
        change = f"model {previous_model[:12]} -> {model[:12]}" if model != previous_model else "same model"
        typer.echo(f"another index took {index} ({change}): following it, catching it up")

    try:
        watcher = GalleryWatcher(
            gallery,
            index,
            Embedder(model_for_index(index, model), threads=threads),
            settle=settle,
            max_batch=max_batch,
            batch_size=batch_size,
            threads=threads,
            on_batch=report,
            on_follow=follow,
        )
        # SIGTERM/SIGINT end the wait for changes, or the batch being applied after its current embedding
        # batch (saved; the rest is caught up at the next start). Stopping a watcher is routine: exit 0.
        with stop_on_signals() as stop:
            watcher.run(stop)
        typer.echo("stopped")
    except StopRequested as stop:
        typer.echo(f"{stop}: the batch in progress is finished at the next start")
