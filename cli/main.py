"""``dmlsearch``: export models, build indexes, query them and serve them."""

from __future__ import annotations

import warnings

import typer

from cli import (
    duplicates_commands,
    explain_commands,
    feedback_commands,
    index_commands,
    model_commands,
    proof_commands,
    serve_commands,
    watch_commands,
)
from cli.usage import plain_usage

# Click's plain help, not Rich's panels: those cut flag names and env variables to "…" at 80 columns and
# read "[default: …]" in a help text as a markup tag, dropping it.
app = typer.Typer(
    help="Image retrieval with deep-metric-learning embeddings.", no_args_is_help=True, rich_markup_mode=None
)
for module in (
    model_commands,
    proof_commands,
    index_commands,
    serve_commands,
    watch_commands,
    duplicates_commands,
    explain_commands,
    feedback_commands,
):
    app.registered_commands.extend(module.commands.registered_commands)
    app.registered_groups.extend(module.commands.registered_groups)
plain_usage(app)


def _plain_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    return f"warning: {message}\n"


@app.callback()
def _command_line() -> None:
    # The engine warns about what it skipped (an unreadable image): say what, not where in our code.
    warnings.formatwarning = _plain_warning


if __name__ == "__main__":
    app()
