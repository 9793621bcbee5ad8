"""``dmlsearch duplicates --tier/--plan/--apply/--undo``: tiered groups with their evidence, and the review
flow (engine.duplicates.review)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import typer

from cli.common import fail


def tiered(
    index: Path,
    tier_name: str,
    *,
    plan: Path | None,
    keep_by: str,
    threshold: float | None,
    max_distance: int | None,
    neighbours: int,
    as_json: bool,
    as_csv: bool,
) -> None:
    """Print (or write as a plan) the groups of ``tier_name``; ``threshold`` and ``max_distance`` are the
    edited tier's cosine and signature bits when given."""
    from engine.duplicates.review import (
        group_members,
        make_plan,
        pair_groups,
        propose,
        review_groups,
        write_plan,
    )
    from engine.duplicates.tiers import EDITED_BITS, EDITED_COSINE, Tier, TierSettings
    from engine.gallery.keeper import GroupVectors, check_rule
    from index.gallery import GalleryIndex

    tier = Tier.parse(tier_name)
    rule = check_rule([key.strip() for key in keep_by.split(",") if key.strip()])
    settings = TierSettings(
        edited_cosine=EDITED_COSINE if threshold is None else threshold,
        edited_bits=EDITED_BITS if max_distance is None else max_distance,
        neighbours=neighbours,
    )
    gallery = GalleryIndex.open(index)
    try:
        root = None if gallery.manifest.gallery_root is None else Path(gallery.manifest.gallery_root)
        if plan is not None and root is None:
            raise fail(f"{index} records no gallery folder: its images cannot be set aside")
        found = review_groups(gallery, pair_groups(gallery, tier, settings))
        if plan is not None and root is not None:
            written = make_plan(found, gallery, index_dir=index, root=root, rule=rule)
        else:  # the keeper rule's proposal, shown with the groups
            items = gallery.items.get_many([int(i) for group in found.groups for i in group.ids])
            vectors = GroupVectors(gallery)
            reviewed = [
                (group, members, propose(group.tier, members, root, rule, vectors))
                for group in found.groups
                if len(members := group_members(group, items)) >= 2
            ]
    finally:
        gallery.close()
    if found.unsigned:
        typer.echo(
            f"note: {found.unsigned} of {found.items} items have no perceptual signature: they can be "
            "edited copies by cosine alone, never exact copies by pixels",
            err=True,
        )
    if plan is not None:
        write_plan(written, plan)
        aside = sum(m["action"] == "set_aside" for g in written["groups"] for m in g["members"])
        for number, group in enumerate(written["groups"], start=1):
            keeper = "" if group["keeper_path"] is None else f"keep {group['keeper_path']}: "
            typer.echo(f"group {number} ({group['tier']}): {keeper}{group['reason']}")
        typer.echo(
            f"wrote {plan}: {len(written['groups'])} {tier.label}-tier groups, {aside} images to set aside; "
            f"keeper rule {' > '.join(rule)} (change with --keep-by, or edit each member's action: keep or "
            f"set_aside), then: dmlsearch duplicates --index {index} --apply {plan}"
        )
        return
    groups: list[dict[str, Any]] = [
        {
            "tier": group.tier.label,
            "keeper": None if proposal.keeper is None else members[proposal.keeper].item.path,
            "reason": proposal.reason,
            "items": [
                {
                    "id": member.item.id,
                    "path": member.item.path,
                    "label": member.item.label,
                    "byte_copy": member.byte_copy,
                    "action": action,
                    "pairs_with": member.evidence.other,
                    "tier": member.evidence.tier.label,
                    "signature_bits": member.evidence.bits,
                    "cosine": member.evidence.cosine,
                    "hash": member.evidence.digest,
                    "alignment": member.evidence.alignment,
                }
                for member, action in zip(members, proposal.actions, strict=True)
            ],
        }
        for group, members, proposal in reviewed
    ]
    if as_json:
        payload = {
            "tier": tier.label,
            "criteria": found.criteria,
            "unsigned": found.unsigned,
            "groups": groups,
        }
        typer.echo(json.dumps(payload, indent=2))
    elif as_csv:
        writer = csv.writer(sys.stdout)
        header = [
            "group",
            "group_tier",
            "id",
            "tier",
            "signature_bits",
            "cosine",
            "hash",
            "path",
            "alignment",
            "byte_copy",
        ]
        writer.writerow(header)
        for number, group in enumerate(groups, start=1):
            writer.writerows(
                [
                    number,
                    group["tier"],
                    row["id"],
                    row["tier"],
                    row["signature_bits"],
                    f"{row['cosine']:.4f}",
                    row["hash"] or "",
                    row["path"],
                    "" if row["alignment"] is None else f"{row['alignment']:.4f}",
                    int(row["byte_copy"]),
                ]
                for row in group["items"]
            )
    else:
        for number, group in enumerate(groups, start=1):
            typer.echo(f"group {number}: {group['tier']}, {len(group['items'])} images")
            keeper = "" if group["keeper"] is None else f"keep {group['keeper']}: "
            typer.echo(f"  {keeper}{group['reason']}")
            for row in group["items"]:
                bits = "-" if row["signature_bits"] is None else row["signature_bits"]
                evidence = f"{row['tier']:<7} bits {bits!s:>2} cosine {row['cosine']:.4f}"
                if row["alignment"] is not None:
                    evidence += f" aligned NCC {row['alignment']:.4f}"
                copy = f"  (same bytes as item {row['pairs_with']}, indexed once)" if row["byte_copy"] else ""
                digest = f"  {row['hash'][:20]}" if row["hash"] else ""
                typer.echo(f"  {evidence}  {row['path']}{digest}{copy}")
        typer.echo(f"{len(groups)} groups up to the {tier.label} tier: {found.criteria}")


def apply_or_undo(index: Path, apply: Path | None, undo: Path | None, *, progress: bool) -> None:
    """``undo``: the plan file, the trash folder of the apply or its plan id."""
    from engine.duplicates.review import apply_plan, find_plan, gallery_root, read_plan_file, undo_plan
    from engine.model.bundle import locate_model
    from engine.model.embedder import Embedder

    if apply is not None:
        plan = read_plan_file(apply)
        report = apply_plan(index, plan, on_move=lambda moved: typer.echo(f"set aside {moved}"))
    else:
        assert undo is not None
        plan = find_plan(gallery_root(index), str(undo))
        model = locate_model(index)
        report = undo_plan(index, plan, Embedder(model.path, card=model.card), progress=progress)
        for moved in report.moved:
            typer.echo(f"put back {moved}")
    for where, why in report.left:
        typer.echo(f"left {where}: {why}", err=True)
    if apply is not None:
        typer.echo(
            f"set aside {len(report.moved)} images ({len(report.already)} were already), removed "
            f"{report.removed} items from the index"
            + (f", {report.handed} now named by a kept copy" if report.handed else "")
            + f"; undo with: dmlsearch duplicates --index {index} --undo {plan['plan_id']}"
        )
    else:
        typer.echo(
            f"put back {len(report.moved)} images ({len(report.already)} were already in place), "
            f"{report.restored} items under their ids, indexed {report.reindexed} again"
        )
