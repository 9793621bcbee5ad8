"""``dmlsearch explain``: why an item matched a query image, drawn as two heatmaps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail, read_query_image, reports_errors, served_as_the_server_serves
from cli.index_commands import BoxOption, StoredModelOption, parse_box

commands = typer.Typer()


@commands.command()
@reports_errors
def explain(
    query: Annotated[Path, typer.Argument(help="Query image file.")],
    item_id: Annotated[int, typer.Argument(min=0, help="The result to explain: its item id in the index.")],
    index: Annotated[Path, typer.Option(help="Index directory.")],
    out: Annotated[Path, typer.Option(help="Where to write the PNG: query and item side by side.")] = Path(
        "why.png"
    ),
    box: BoxOption = None,
    model: StoredModelOption = None,
) -> None:
    """Write the query (or its box) and the item with the positions that carried their similarity coloured,
    and print the cosine with each image's share of it (positions plus the head's biases;
    engine.serve.explain) and each image's peak window (outlined): the two regions, one in each image, that
    show the same thing most specifically, with the share of the cosine they carry between them."""
    from engine.decode.images import ImageDecodeError
    from engine.serve.heatmap_image import png_bytes, side_by_side
    from foundation.atomic import atomic_write_bytes

    query_bytes = read_query_image(query)
    region = parse_box(box)
    try:
        with served_as_the_server_serves(model, index) as service:
            explanation = service.explanations.explain(query_bytes, item_id, region)
    except ImageDecodeError as err:  # named by its file
        raise fail(f"{query}: {err.message}") from None
    atomic_write_bytes(out, png_bytes(side_by_side(explanation)))
    for line in explanation.in_words():
        typer.echo(line)
    view = explanation.query.view.shape[0]
    typer.echo(
        f"Outlined: {explanation.query.peak_box} in the query, {explanation.item.peak_box} in the result "
        f"(x0, y0, x1, y1 in pixels of the model's {view}-pixel view)."
    )
    typer.echo(f"wrote {out}")
