"""Serving near-duplicate groups of the served index: found once per threshold and index state, then paged."""

from __future__ import annotations

from engine.serving import CurrentBundle
from index.duplicates import DuplicateGroup, find_duplicates
from index.protocol import Item


class DuplicateFinder:
    def __init__(self, current: CurrentBundle) -> None:
        self.current = current
        self._groups: dict[tuple[object, ...], list[DuplicateGroup]] = {}  # of the index as loaded

    def page(self, threshold: float, offset: int, limit: int) -> tuple[list[list[tuple[Item, float]]], int]:
        """A page of near-duplicate groups, largest first (each item with its highest cosine to another
        member), and the number of groups. Groups are computed once per threshold and index state."""
        with self.current.reading() as bundle:
            index = bundle.index
            state = (index.stamp, id(index), len(index))
            groups = self._groups.get((*state, threshold))
            if groups is None:
                groups = find_duplicates(index, threshold)
                self._groups = {key: value for key, value in self._groups.items() if key[:3] == state} | {
                    (*state, threshold): groups
                }
            page = groups[offset : offset + limit]
            items = index.items.get_many([int(i) for group in page for i in group.ids])
        rows = [
            [
                (items[int(i)], float(score))
                for i, score in zip(group.ids, group.scores, strict=True)
                if int(i) in items
            ]
            for group in page
        ]
        return rows, len(groups)
