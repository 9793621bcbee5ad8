"""Serving near-duplicate groups of the served index: found once per setting and index state, then paged."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.decode.pool import Decoder
from engine.duplicates.groups import DEFAULT_MAX_DISTANCE, Duplicates, find_duplicates
from engine.duplicates.review import (
    PlanError,
    ReviewReport,
    applied_plan,
    group_members,
    pair_groups,
    propose,
    put_back,
    review_groups,
    set_aside,
)
from engine.duplicates.tiers import Evidence, Tier, TieredDuplicates
from engine.gallery.keeper import FileFacts, GroupVectors
from engine.gallery.shared import require_shared_gallery
from engine.serve.loaded_bundle import CurrentBundle
from foundation.defaults import KEEPER_RULE
from index.protocol import Item


@dataclass(frozen=True)
class DuplicatePage:
    rows: list[list[tuple[Item, float]]]  # each group's items with their highest cosine in the group
    total: int  # groups in all
    threshold: float  # the cosine cut used (the index's default when none was asked for)
    max_distance: int
    unsigned: int  # items judged by the embedding alone
    note: str | None
    criteria: str  # how pairs were judged (engine.duplicates.groups.Duplicates.criteria)


@dataclass(frozen=True)
class TieredMember:
    item: Item  # a byte copy's: its item's, under the copy's path
    evidence: Evidence
    facts: FileFacts
    action: str  # the keeper rule's proposal: keep or set_aside
    byte_copy: bool  # a file with an item's bytes, which the index holds once (engine.duplicates.byte_copies)


@dataclass(frozen=True)
class ReviewedGroup:
    tier: Tier
    members: list[TieredMember]
    reason: str  # why the keeper was chosen (or why every member is kept)


@dataclass(frozen=True)
class TieredPage:
    groups: list[ReviewedGroup]
    found: TieredDuplicates
    keeper_rule: tuple[str, ...]


class DuplicateFinder:
    def __init__(self, current: CurrentBundle, decoder: Decoder | None = None) -> None:
        self.current = current
        self.decoder = decoder  # reads the pixels of gallery files (None: here)
        self._found: dict[tuple[object, ...], Duplicates] = {}  # of the index as loaded
        self._tiered: dict[tuple[object, ...], TieredDuplicates] = {}

    def page(
        self,
        threshold: float | None,
        offset: int,
        limit: int,
        max_distance: int = DEFAULT_MAX_DISTANCE,
    ) -> DuplicatePage:
        """A page of near-duplicate groups, largest first. Groups are found once per setting and index
        state; ``threshold`` None is the index's default (see
        ``engine.duplicates.groups.find_duplicates``)."""
        with self.current.reading() as bundle:
            index = bundle.index
            state = (index.stamp, id(index), len(index))
            found = self._found.get((*state, threshold, max_distance))
            if found is None:
                found = find_duplicates(index, threshold, max_distance=max_distance)
                self._found = {key: value for key, value in self._found.items() if key[:3] == state} | {
                    (*state, threshold, max_distance): found
                }
            page = found.groups[offset : offset + limit]
            items = index.items.get_many([int(i) for group in page for i in group.ids])
        rows = [
            [
                (items[int(i)], float(score))
                for i, score in zip(group.ids, group.scores, strict=True)
                if int(i) in items
            ]
            for group in page
        ]
        return DuplicatePage(
            rows,
            len(found.groups),
            found.threshold,
            found.max_distance,
            found.unsigned,
            found.note,
            found.criteria,
        )

    def tiered_page(
        self, tier: Tier, offset: int, limit: int, rule: tuple[str, ...] = KEEPER_RULE
    ) -> TieredPage:
        """A page of the groups of ``tier`` (``engine.duplicates.tiers``), each member with its evidence and
        the keeper rule's proposal; pairs found once per tier and index state, byte copies each time."""
        with self.current.reading() as bundle:
            index = bundle.index
            root = Path(index.manifest.gallery_root) if index.manifest.gallery_root else None
            state = (index.stamp, id(index), len(index))
            pairs = self._tiered.get((*state, tier))
            if pairs is None:
                pairs = pair_groups(index, tier, decoder=self.decoder)
                self._tiered = {key: value for key, value in self._tiered.items() if key[:3] == state} | {
                    (*state, tier): pairs
                }
            found = review_groups(index, pairs)  # byte copies: looked for on every page
            page = found.groups[offset : offset + limit]
            items = index.items.get_many([int(i) for group in page for i in group.ids])
            vectors = GroupVectors(index)
            groups = []
            for group in page:
                members = group_members(group, items)
                proposal = propose(group.tier, members, root, rule, vectors)
                reviewed = [
                    TieredMember(member.item, member.evidence, fact, action, member.byte_copy)
                    for member, fact, action in zip(members, proposal.facts, proposal.actions, strict=True)
                ]
                groups.append(ReviewedGroup(group.tier, reviewed, proposal.reason))
        return TieredPage(groups, found, rule)

    def apply(self, plan: dict) -> ReviewReport:
        """Set aside a plan's non-keepers in the served index (``engine.duplicates.review``), alone."""
        with self.current.writing() as bundle:
            require_shared_gallery(bundle.index)
            return set_aside(bundle.index, plan)

    def undo(self, plan_id: str) -> ReviewReport:
        """Undo the apply of ``plan_id`` in the served index, from the plan its trash folder holds."""
        with self.current.writing() as bundle:
            require_shared_gallery(bundle.index)
            root = bundle.index.manifest.gallery_root
            if root is None:
                raise PlanError("the index records no gallery folder: nothing was set aside from it")
            plan = applied_plan(Path(root), plan_id)
            return put_back(bundle.index, plan, bundle.embedder)
