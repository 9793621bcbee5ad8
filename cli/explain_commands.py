"""``dmlsearch explain``: why an item matched a query image, drawn as two heatmaps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail
from cli.index_commands import EXPECTED_ERRORS, StoredModelOption

commands = typer.Typer()


@commands.command()
def explain(
    query: Annotated[Path, typer.Argument(help="Query image file.")],
    item_id: Annotated[int, typer.Argument(min=0, help="The result to explain: its item id in the index.")],
    index: Annotated[Path, typer.Option(help="Index directory.")],
    out: Annotated[Path, typer.Option(help="Where to write the PNG: query and item side by side.")] = Path(
        "why.png"
    ),
    model: StoredModelOption = None,
) -> None:
    """Write the query and the item with the positions that carried their similarity coloured, and print
    the cosine with each image's share of it (positions plus the head's biases; engine.explain)."""
    from engine.explain import ExplainUnavailableError
    from engine.heatmap_image import png_bytes, side_by_side
    from engine.images import ImageDecodeError
    from engine.item_reader import ItemNotFoundError
    from engine.search import SearchService
    from index.atomic import atomic_write_bytes
    from index.gallery import IndexMismatchError

    if not query.is_file():
        raise fail(f"query image {query} does not exist")
    try:
        service = SearchService.open(model, index)
        explanation = service.explanations.explain(query.read_bytes(), item_id)
    except ImageDecodeError as err:
        raise fail(f"{query}: {err.message}") from None
    except (ItemNotFoundError, ExplainUnavailableError, IndexMismatchError, *EXPECTED_ERRORS) as err:
        raise fail(str(err)) from None
    atomic_write_bytes(out, png_bytes(side_by_side(explanation)))
    service.close()
    typer.echo(f"cosine {explanation.cosine:.4f}")
    for name, heatmap in (("query", explanation.query), ("item", explanation.item)):
        typer.echo(f"{name}: positions {heatmap.grid.sum():+.4f}, rest {heatmap.rest:+.4f}")
    typer.echo(f"wrote {out}")
