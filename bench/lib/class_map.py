"""An index scored by a private class map (the new-user trials, issues 39 and 40): the photos' true
classes, kept apart from the folder the user indexes, so that the folder itself stays unlabelled.

A class map is JSON, ``{"IMG_0001.jpg": {"class_id": 123, ...}, ...}``, keyed by the path of each photo
relative to the indexed folder (the item's path as ``build-index`` stored it).
"""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

import numpy as np

from index.gallery import GalleryIndex
from training.metrics import retrieval_metrics


def load_class_map(path: Path) -> dict[str, int]:
    """Each photo's path -> its class id."""
    return {name: int(entry["class_id"]) for name, entry in json.loads(path.read_text()).items()}


def indexed_by_class(index_dir: Path, classes: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The item ids, stored vectors and true classes of the index's items that the map names."""
    with closing(GalleryIndex.open(index_dir, read_only=True)) as index:
        items = [item for item in index.items.scan() if item.path in classes]
        ids = np.array([item.id for item in items], dtype=np.int64)
        vectors = index.items.vectors(ids)
    return ids, vectors, np.array([classes[item.path] for item in items])


def class_recall(index_dir: Path, classes: dict[str, int]) -> dict[str, float]:
    """Each mapped item searched among the others by its stored vector: ``recall@K``, ``map@r`` by class."""
    _, vectors, labels = indexed_by_class(index_dir, classes)
    return {"items": float(len(labels)), **retrieval_metrics(vectors, labels)}
