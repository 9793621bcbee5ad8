"""``dmlsearch``: export models, build indexes, query them and serve them."""

from __future__ import annotations

import typer

from cli import (
    duplicates_commands,
    index_commands,
    model_commands,
    proof_commands,
    serve_commands,
    watch_commands,
)

app = typer.Typer(help="Image retrieval with deep-metric-learning embeddings.", no_args_is_help=True)
for module in (
    model_commands,
    proof_commands,
    index_commands,
    serve_commands,
    watch_commands,
    duplicates_commands,
):
    app.registered_commands.extend(module.commands.registered_commands)
    app.registered_groups.extend(module.commands.registered_groups)


if __name__ == "__main__":
    app()
