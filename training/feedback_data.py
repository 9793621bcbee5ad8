"""The judgments kept with an index (issue 40), made into training pairs: ``dmlsearch train --feedback``.

A judgment says of one query and one result: alike (👍, +1) or not (👎, -1). Training reads them from the
index (``index.judgments``, SQLite for FAISS, the ``<collection>_judgments`` collection for Milvus, so a
judgment made through any replica is here), with each judged item's photo (the gallery root + its path)
and the vector the index serves for it (the model before training, for the gate).

- What trains: judgments whose query is an item. An uploaded query's photo is not kept, only its hash and
  its embedding by the serving model, which a run training from backbone features cannot use: those are
  counted (``uploads``) and left out. One pair judged twice keeps its latest sign.
- Held out: whole queries, drawn at random (seeded), never trained on: ``test``, the gate's
  (:mod:`training.feedback_gate`), and, for a run on judgments alone, ``val``, which selects its checkpoint
  (a run with a data folder selects on the folder's validation classes instead). Only queries with both a
  👍 and a 👎 can say whether a model ranks the one above the other, so those are the ones held out.
- Certain pairs (:meth:`Closure.signs`): a 👍 joins two photos; photos joined through 👍s are alike (one
  component, union-find); a 👎 between two photos makes their components unlike. A direct 👎 between two
  photos of one component wins for that pair. Two views of one photo are alike. Every other pair is left
  to the labels (:func:`training.losses.pairs.pair_masks`): none for photos known only from judgments.
- Unjudged: a seeded sample of :data:`UNJUDGED_SAMPLE` items that no judgment names, the photos the user
  never looked at, which the gate checks without labels (:mod:`training.feedback_gate`): training on
  judgments must not spoil what nobody judged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.gallery import GalleryIndex
from training.data import DataError

HELD_OUT_SHARE = 0.2  # of the rankable queries (a 👍 and a 👎), for the gate; as much again for val alone
# Unjudged photos the gate checks: 500 give the check's Recall@1 an interval of a few points, and take
# well under a minute to decode and embed once more (one augmented view each) on a 2-core machine.
UNJUDGED_SAMPLE = 500


@dataclass(frozen=True)
class JudgedPair:
    """One judgment on two gallery items: ``query``'s result ``result`` is alike (+1) or not (-1)."""

    query: int
    result: int
    sign: int


@dataclass(frozen=True)
class Feedback:
    """The judgments of one index, split by query; photos and served vectors of every item they name."""

    index: Path
    train: tuple[JudgedPair, ...]
    val: tuple[JudgedPair, ...]  # empty unless the run trains on judgments alone
    test: tuple[JudgedPair, ...]  # the gate's: never trained on, never selected on
    root: Path  # the index's gallery folder
    paths: dict[int, str]  # item id -> its photo, relative to root
    served: dict[int, np.ndarray]  # item id -> the vector the index serves for it (before training)
    uploads: int  # judgments of uploaded queries, left out (no photo to train from)
    model_fingerprint: str  # the model the index serves: its vectors are the served ones
    unjudged: tuple[int, ...] = ()  # a seeded sample of the items no judgment names (module docstring)

    def items(self, pairs: Iterable[JudgedPair]) -> list[int]:
        """The items ``pairs`` name, each once, in order of first appearance."""
        return list(dict.fromkeys(item for pair in pairs for item in (pair.query, pair.result)))


def load_feedback(index: Path, *, seed: int, validation: bool) -> Feedback:
    """The judgments of the index at ``index``, split as the module says (``validation``: a val share too).

    Fails with a clear message where nothing could train or nothing could be held out.
    """
    with closing(GalleryIndex.open(index, read_only=True)) as gallery:
        latest: dict[tuple[int, int], int] = {}
        uploads = 0
        named: set[int] = set()  # every item a judgment names, an uploaded query's results too
        for judgment in gallery.judgments.scan():  # id order: a later judgment of a pair replaces it
            named.add(judgment.result)
            if judgment.query.item is None:
                uploads += 1
                continue
            named.add(judgment.query.item)
            if judgment.query.item != judgment.result:
                latest[(judgment.query.item, judgment.result)] = judgment.sign
        pairs = [JudgedPair(query, result, sign) for (query, result), sign in latest.items()]
        judged = {item for pair in pairs for item in (pair.query, pair.result)}
        rest = [item.id for item in gallery.items.scan() if item.id not in named]
        draw = np.random.default_rng(seed).permutation(len(rest))[:UNJUDGED_SAMPLE]
        unjudged = tuple(sorted(rest[int(k)] for k in draw))
        ids = sorted(judged | set(unjudged))
        found = gallery.items.get_many(ids)
        root = gallery.manifest.gallery_root
        fingerprint = gallery.manifest.model_fingerprint
        served = dict(zip(ids, gallery.vectors(ids), strict=True)) if ids else {}
    if root is None:
        raise DataError(f"{index} records no gallery folder: its judged photos cannot be read for training")
    pairs = [pair for pair in pairs if pair.query in found and pair.result in found]
    train, val, test = _split_by_query(pairs, seed=seed, validation=validation)
    if not test:
        rankable = _rankable_count(pairs)
        more = _least_rankable(validation) - rankable
        raise DataError(
            f"{index} has too few judged queries to train on: the gate holds out queries with both a 👍 and "
            f"a 👎 ({rankable} here) and needs some left to train on; judge more: at least {more} more "
            f"{'query' if more == 1 else 'queries'} with both, a 👎 on a wrong result near the top and a 👍 "
            "on a right one (pair losses learn from the wrong results ranked high)"
        )
    paths = {item: found[item].path for item in ids if item in found}
    return Feedback(index, train, val, test, Path(root), paths, served, uploads, fingerprint, unjudged)


def _least_rankable(validation: bool) -> int:
    """The fewest rankable queries a run can split: a held-out share (two with ``validation``) and one to
    train on."""
    return (2 if validation else 1) + 1


def _rankable_count(pairs: Sequence[JudgedPair]) -> int:
    return len(_rankable(pairs))


def _rankable(pairs: Sequence[JudgedPair]) -> list[int]:
    signs: dict[int, set[int]] = {}
    for pair in pairs:
        signs.setdefault(pair.query, set()).add(pair.sign)
    return sorted(query for query, seen in signs.items() if seen == {1, -1})


def _split_by_query(
    pairs: Sequence[JudgedPair], *, seed: int, validation: bool
) -> tuple[tuple[JudgedPair, ...], tuple[JudgedPair, ...], tuple[JudgedPair, ...]]:
    """``(train, val, test)``: a seeded draw of the rankable queries held out whole, the rest trains."""
    rankable = np.random.default_rng(seed).permutation(np.array(_rankable(pairs), dtype=np.int64))
    share = math.ceil(HELD_OUT_SHARE * len(rankable))
    if len(rankable) < _least_rankable(validation):
        return tuple(pairs), (), ()
    test_queries = set(rankable[:share].tolist())
    val_queries = set(rankable[share : 2 * share].tolist()) if validation else set()
    return (
        tuple(p for p in pairs if p.query not in test_queries | val_queries),
        tuple(p for p in pairs if p.query in val_queries),
        tuple(p for p in pairs if p.query in test_queries),
    )


class Closure:
    """The certain pairs that judgments imply (module docstring): components of 👍, 👎 between them."""

    def __init__(self, pairs: Iterable[JudgedPair]) -> None:
        pairs = list(pairs)
        parent: dict[int, int] = {}

        def root(item: int) -> int:
            while parent.setdefault(item, item) != item:
                item = parent[item]
            return item

        for pair in pairs:
            first, second = root(pair.query), root(pair.result)
            if pair.sign > 0 and first != second:
                parent[max(first, second)] = min(first, second)
        roots = {item: root(item) for item in list(parent)}
        numbers: dict[int, int] = {}
        # item -> its component, numbered from 0 in order of first appearance
        self.component = {item: numbers.setdefault(top, len(numbers)) for item, top in roots.items()}
        self.unlike = np.zeros((len(numbers), len(numbers)), dtype=bool)
        self.conflicts: list[tuple[int, int]] = []  # 👎 inside one component: that pair alone is unlike
        for pair in pairs:
            if pair.sign < 0:
                a, b = self.component[pair.query], self.component[pair.result]
                self.unlike[a, b] = self.unlike[b, a] = True
                if a == b:
                    self.conflicts.append((pair.query, pair.result))

    def components(self, items: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each item's component; -1 for an item no judgment names (or -1, a row showing no item)."""
        return np.array([self.component.get(int(item), -1) for item in items], dtype=np.int64)

    def signs(self, items: Sequence[int] | np.ndarray) -> np.ndarray:
        """The (B, B) int8 sign matrix of a batch whose rows show ``items``: +1 alike (the same photo
        too), -1 unlike, 0 unknown; the diagonal 0."""
        items = np.asarray(items, dtype=np.int64)
        components = self.components(items)
        judged = components >= 0
        both = judged[:, None] & judged[None, :]
        safe = np.where(judged, components, 0)
        out = np.where(self.unlike[safe[:, None], safe[None, :]], -1, 0).astype(np.int8)
        out[components[:, None] == components[None, :]] = 1
        for first, second in self.conflicts:
            rows, others = np.flatnonzero(items == first), np.flatnonzero(items == second)
            out[np.ix_(rows, others)] = out[np.ix_(others, rows)] = -1
        out[~both] = 0
        np.fill_diagonal(out, 0)
        return out
