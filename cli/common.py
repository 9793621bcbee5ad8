"""What every command module shares: CLI errors."""

from __future__ import annotations

import typer


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` in red on stderr; raise the returned exit (code 2)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=2)
