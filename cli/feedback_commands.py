"""``dmlsearch feedback list|export|clear``: the judgments (👍/👎) kept with an index (index.judgments)."""

from __future__ import annotations

import csv
import io
import json
import sys
from contextlib import closing
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail, reports_errors
from foundation.atomic import atomic_write_text
from index.gallery import GalleryIndex
from index.judgments import Judgment, as_record

commands = typer.Typer()
feedback_app = typer.Typer(
    help="The judgments (👍/👎 on search results) kept with an index.", no_args_is_help=True
)
commands.add_typer(feedback_app, name="feedback")

IndexDir = Annotated[Path, typer.Option("--index", help="Index directory.")]
# The fields of an exported judgment (index.judgments.as_record's), in this order: CSV's header.
FIELDS = ("id", "query_item", "query_hash", "result", "sign", "time", "model_fingerprint", "query_embedding")


class ExportFormat(StrEnum):
    JSONL = "jsonl"
    CSV = "csv"


def _export_text(judgments: list[Judgment], form: ExportFormat) -> str:
    records = [as_record(judgment) for judgment in judgments]
    if form is ExportFormat.JSONL:
        return "".join(json.dumps(record) + "\n" for record in records)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for record in records:  # the embedding as a JSON list in its cell; empty cells for nulls
        embedding = record["query_embedding"]
        writer.writerow({**record, "query_embedding": "" if embedding is None else json.dumps(embedding)})
    return text.getvalue()


@feedback_app.command("list")
@reports_errors
def list_judgments(
    index: IndexDir,
    offset: Annotated[int, typer.Option(min=0, help="Skip this many judgments.")] = 0,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many.")] = 100,
) -> None:
    """Print the judgments in id order: id, query (an item id or an uploaded image's hash), result, sign,
    time, model."""
    with closing(GalleryIndex.open(index, read_only=True)) as gallery:
        judgments, total = gallery.judgments.page(offset, limit), len(gallery.judgments)
    for judgment in judgments:
        query = judgment.query
        asked = f"item {query.item}" if query.item is not None else f"upload {str(query.content_hash)[:12]}"
        typer.echo(
            f"{judgment.id}\t{asked}\tresult {judgment.result}\t{judgment.sign:+d}\t{judgment.time}\t"
            f"model {judgment.model_fingerprint[:12]}"
        )
    typer.echo(f"{len(judgments)} of {total} judgments in {index}", err=True)


@feedback_app.command()
@reports_errors
def export(
    index: IndexDir,
    out: Annotated[Path | None, typer.Option(help="Write to this file (default: standard output).")] = None,
    form: Annotated[ExportFormat, typer.Option("--format", help="JSON lines or CSV.")] = ExportFormat.JSONL,
) -> None:
    """Write every judgment, with an uploaded query's embedding where kept (a JSON list of floats)."""
    with closing(GalleryIndex.open(index, read_only=True)) as gallery:
        judgments = list(gallery.judgments.scan())
    text = _export_text(judgments, form)
    if out is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(out, text)
        typer.echo(f"wrote {len(judgments)} judgments to {out}", err=True)


@feedback_app.command()
@reports_errors
def clear(
    index: IndexDir,
    yes: Annotated[bool, typer.Option("--yes", help="Really delete every judgment of the index.")] = False,
) -> None:
    """Delete every judgment of the index (asks for --yes: they cannot be brought back)."""
    with closing(GalleryIndex.open(index)) as gallery:
        count = len(gallery.judgments)
        if not yes:
            raise fail(f"this deletes the {count} judgments of {index} for good: give --yes to go on")
        gallery.judgments.clear()
    typer.echo(f"deleted {count} judgments from {index}")
