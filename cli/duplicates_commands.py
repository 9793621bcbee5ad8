"""``dmlsearch duplicates``: groups of near-duplicate images in an index."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli import duplicate_review_commands as review_commands
from cli.common import fail, reports_errors
from engine.duplicates.groups import (
    DEFAULT_MAX_DISTANCE,
    DEFAULT_NEIGHBOURS,
    DEFAULT_THRESHOLD,
    EMBEDDING_ONLY_THRESHOLD,
    MAX_DISTANCE_LIMIT,
)
from engine.duplicates.tiers import EDITED_BITS, TIER_NAMES
from foundation.defaults import KEEPER_RULE

KEEPER_HELP = (
    "Keeper rule: the order in which camera (the file with the camera's EXIF), source (not a crop or "
    "reduction of another), date (the earliest capture time by the camera's clock), folder (in its label "
    "folder), centre (nearest the others), file-time (the earliest file time), pixels (most) and bytes "
    "(largest) decide which file of a group is kept."
)

commands = typer.Typer()


@commands.command()
@reports_errors
def duplicates(
    index: Annotated[Path, typer.Option(help="Index directory.")],
    threshold: Annotated[
        float | None,
        typer.Option(
            min=-1.0,
            max=1.0,
            help=f"Cosine at or above which two images may be copies [default: {DEFAULT_THRESHOLD} when "
            f"every image has a perceptual signature, else {EMBEDDING_ONLY_THRESHOLD}].",
            show_default=False,
        ),
    ] = None,
    max_distance: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_DISTANCE_LIMIT,
            help="Perceptual-signature bits (of 64) two copies may differ by "
            f"[default: {DEFAULT_MAX_DISTANCE}, with --tier {EDITED_BITS}].",
            show_default=False,
        ),
    ] = None,
    neighbours: Annotated[
        int,
        typer.Option(min=1, max=1000, help="Candidate neighbours searched per image without a signature."),
    ] = DEFAULT_NEIGHBOURS,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="One row per image: group,id,score,label,path.")
    ] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = False,
    tier: Annotated[
        str | None,
        typer.Option(
            help=f"Group by tier: {', '.join(TIER_NAMES)} (each includes the stricter ones); each group says "
            "its tier and each image its evidence.",
            show_default=False,
        ),
    ] = None,
    plan: Annotated[
        Path | None, typer.Option(help="Write the groups of --tier (default edited) as a plan to review.")
    ] = None,
    keep_by: Annotated[str, typer.Option(help=KEEPER_HELP)] = ",".join(KEEPER_RULE),
    apply: Annotated[
        Path | None, typer.Option(help="Move a plan's set-aside images to the gallery's trash folder.")
    ] = None,
    undo: Annotated[
        Path | None,
        typer.Option(
            help="Put an applied plan's set-aside images and their items back: the plan file, the trash "
            "folder of the apply (.dmlsearch-trash/PLAN_ID) or its plan id.",
        ),
    ] = None,
) -> None:
    """Print groups of near-duplicate images: images joined by chains of pairs whose perceptual signatures
    are within MAX_DISTANCE bits and whose cosine is >= THRESHOLD, each with its highest cosine to another
    member. Images indexed before signatures were stored are judged by cosine alone (a note says so)."""
    from engine.duplicates.groups import find_duplicates
    from index.gallery import GalleryIndex

    if as_json and as_csv:
        raise fail("choose one of --json and --csv")
    if sum(option is not None for option in (plan, apply, undo)) > 1:
        raise fail("choose one of --plan, --apply and --undo")
    if apply is not None or undo is not None:
        review_commands.apply_or_undo(index, apply, undo, progress=progress)
        return
    if tier is not None or plan is not None:
        review_commands.tiered(
            index,
            tier or "edited",
            plan=plan,
            keep_by=keep_by,
            threshold=threshold,
            max_distance=max_distance,
            neighbours=neighbours,
            as_json=as_json,
            as_csv=as_csv,
        )
        return
    gallery = GalleryIndex.open(index)
    try:
        found = find_duplicates(
            gallery,
            threshold,
            max_distance=DEFAULT_MAX_DISTANCE if max_distance is None else max_distance,
            neighbours=neighbours,
            progress=progress,
        )
        items = gallery.items.get_many([int(i) for group in found.groups for i in group.ids])
    finally:
        gallery.close()
    rows = [
        [(items[int(i)], float(score)) for i, score in zip(group.ids, group.scores, strict=True)]
        for group in found.groups
    ]
    if found.note:
        typer.echo(f"note: {found.note}", err=True)
    if as_json:
        payload = {
            "threshold": found.threshold,
            "max_distance": found.max_distance,
            "unsigned": found.unsigned,
            "groups": [
                [
                    {"id": item.id, "path": item.path, "label": item.label, "score": score}
                    for item, score in row
                ]
                for row in rows
            ],
        }
        typer.echo(json.dumps(payload, indent=2))
    elif as_csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(["group", "id", "score", "label", "path"])
        for number, row in enumerate(rows, start=1):
            writer.writerows(
                [number, item.id, f"{score:.4f}", item.label or "", item.path] for item, score in row
            )
    else:
        for number, row in enumerate(rows, start=1):
            typer.echo(f"group {number}: {len(row)} images")
            for item, score in row:
                typer.echo(f"  {score:7.4f}  {item.label or '-':<24} {item.path}")
        typer.echo(f"{len(rows)} groups of near-duplicates at {found.criteria}")
