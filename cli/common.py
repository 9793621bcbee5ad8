"""What every command module shares: the default model path and CLI errors."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_MODEL = Path("artifacts/model/model.onnx")


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` in red on stderr; raise the returned exit (code 2)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=2)
