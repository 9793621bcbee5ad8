"""A simulated user of the feedback loop (issue 40): a labelled gallery indexed by the pretrained model, and
queries whose top results are judged by their true class, kept with the index as a person's would be."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path

import numpy as np

from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from index.protocol import Entry
from index.selection import IndexOptions
from training.features import FeatureExtractor


def index_gallery(
    root: Path, files: Sequence[Path], labels: Sequence[str], directory: Path, cache: Path
) -> int:
    """A flat FAISS index at ``directory`` of ``files`` (under ``root``), embedded by the pretrained backbone
    (its features cached in ``cache``), each item labelled; returns how many items it holds."""
    extractor = FeatureExtractor(cache, progress=False)
    features = extractor.extract(list(files))
    kept = np.flatnonzero(features.ok)
    entries = [
        Entry(
            files[i].relative_to(root).as_posix(),
            labels[i],
            hashlib.sha256(files[i].read_bytes()).hexdigest(),
        )
        for i in kept
    ]
    with closing(
        GalleryIndex.create(
            directory,
            dim=features.features.shape[1],
            model_fingerprint=extractor.embedder.fingerprint,
            gallery_root=root,
            options=IndexOptions("flat"),
        )
    ) as index:
        index.add(features.features[kept], entries)
        index.save()
    return len(kept)


def judge_top(directory: Path, queries: Sequence[int], top: int) -> int:
    """Search each query item's vector, and judge its ``top`` results (itself left out) by the true class:
    👍 the query's label, 👎 another, as GET /v1/items/{id}/similar would show them; returns the count."""
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    made = 0
    with closing(GalleryIndex.open(directory)) as index:
        fingerprint = index.manifest.model_fingerprint
        found = index.items.get_many(list(queries))
        for query, hits in zip(queries, index.search(index.vectors(list(queries)), top + 1), strict=True):
            for hit in [hit for hit in hits if hit.item.id != query][:top]:
                sign = 1 if hit.item.label == found[query].label else -1
                index.judgments.add(JudgedQuery(item=query), hit.item.id, sign, fingerprint, now)
                made += 1
        index.save()
    return made
