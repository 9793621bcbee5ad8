"""Serving near-duplicate groups of the served index: found once per setting and index state, then paged."""

from __future__ import annotations

from dataclasses import dataclass

from engine.serving import CurrentBundle
from index.duplicates import DEFAULT_MAX_DISTANCE, Duplicates, find_duplicates
from index.protocol import Item


@dataclass(frozen=True)
class DuplicatePage:
    rows: list[list[tuple[Item, float]]]  # each group's items with their highest cosine in the group
    total: int  # groups in all
    threshold: float  # the cosine cut used (the index's default when none was asked for)
    max_distance: int
    unsigned: int  # items judged by the embedding alone
    note: str | None
    criteria: str  # how pairs were judged (index.duplicates.Duplicates.criteria)


class DuplicateFinder:
    def __init__(self, current: CurrentBundle) -> None:
        self.current = current
        self._found: dict[tuple[object, ...], Duplicates] = {}  # of the index as loaded

    def page(
        self,
        threshold: float | None,
        offset: int,
        limit: int,
        max_distance: int = DEFAULT_MAX_DISTANCE,
    ) -> DuplicatePage:
        """A page of near-duplicate groups, largest first. Groups are found once per setting and index
        state; ``threshold`` None is the index's default (see ``index.duplicates.find_duplicates``)."""
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
