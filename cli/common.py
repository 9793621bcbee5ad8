"""What every command module shares: CLI errors and which model an index is built with."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import typer

from foundation import defaults
from foundation.errors import DmlsearchError
from foundation.names import readable_name
from foundation.regular_files import read_image_file

if TYPE_CHECKING:
    from engine.build.report import MovedFile
    from engine.serve.search import SearchService


def model_for_index(index: Path, model: Path | None) -> Path:
    """The model to build or update ``index`` with: ``model`` if given, else the one an existing index
    carries, else the default export path."""
    from engine.model.bundle import stored_model
    from index.manifest import MANIFEST_NAME, Manifest

    if model is not None:
        return model
    if (index / MANIFEST_NAME).is_file():
        stored = stored_model(index, Manifest.load(index))
        if stored is not None:
            return stored
    return defaults.MODEL_PATH


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` in red on stderr; raise the returned exit (code 2)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=2)


def read_query_image(path: Path) -> bytes:
    """The bytes of the query image file ``path``, or an error that says what ``path`` is instead."""
    if path.is_dir():
        raise fail(f"{readable_name(str(path))} is a folder, not a regular file: a query is an image file")
    if not path.exists():
        raise fail(f"query image {path} does not exist")
    return read_image_file(path)  # a FIFO or a device is refused, not waited on


@contextmanager
def served_as_the_server_serves(model: Path | None, index: Path) -> Iterator[SearchService]:
    """The index served under the server's rules and decode limits (the same settings: ``DMLSEARCH_*``
    and .env): the query image is decoded in a decode process, within each image's limits and a request's
    budget (before, ``query`` and ``explain`` decoded in their own process without any: 167 s for one
    hostile file)."""
    from app.settings import Settings
    from app.state import EngineState
    from engine.decode.pool import DecodePool
    from engine.serve.search import SearchService

    settings = Settings()
    with DecodePool(1, settings.decode_limits()) as decoder:
        service = SearchService.open(model, index, config=EngineState.config(settings, decoder))
        try:
            yield service
        finally:
            service.close()


P = ParamSpec("P")
R = TypeVar("R")


def reports_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Print the errors a user can act on as ``error: message`` and exit 2: a :class:`DmlsearchError`, or
    the operating system refusing a file (missing, no permission, disk full). Anything else is a bug and
    keeps its traceback (exit 1)."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (DmlsearchError, OSError) as err:
            raise fail(str(err)) from None

    return run


def require_training() -> None:
    """Fail with a clear error where the `train` extra is missing (the serving image has no torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise fail(
            "this command needs the train extra (torch): pip install 'dmlsearch[train]', "
            "or use the train image (docker/README.md)"
        ) from None


def echo_duplicate_files(duplicates: list[tuple[str, str]]) -> None:
    """Name each file that was not embedded because an indexed file has the same bytes."""
    for path, original in duplicates:
        typer.echo(f"  {readable_name(path)}: same content as {readable_name(original)} (indexed once)")


def echo_moves(moves: list[MovedFile]) -> None:
    """Name each renamed or moved file (same content: same item id) and the label change a move made."""
    for move in moves:
        relabelled = (
            f" (label {move.old_label or '-'} -> {move.new_label or '-'})"
            if move.old_label != move.new_label
            else ""
        )
        typer.echo(f"  {readable_name(move.old_path)} -> {readable_name(move.new_path)}{relabelled}")


def moves_heading(moves: list[MovedFile]) -> str:
    """``moved or renamed (3, 1 to another label):``"""
    relabelled = sum(move.old_label != move.new_label for move in moves)
    return f"moved or renamed ({len(moves)}{f', {relabelled} to another label' if relabelled else ''}):"
