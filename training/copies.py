"""Which photos of a label-free run's folder are copies of one photo: certain positives without a label.

Byte copies (the same content hash) and the duplicate finder's edited tier (``engine.duplicates.tiers``: a
photo re-encoded, resized, cropped, mirrored, turned, colour-adjusted) are found by the finder itself, on a
temporary FAISS index of the folder's photos: their perceptual signatures
(``engine.duplicates.signature``, from the same decode as indexing) and the untrained backbone's pooled
embedding, which is what an untrained model serves. The finder's defaults were chosen for that embedding
(bench/results/duplicate_tiers.md: edited pairs 98% precise on Cars196 photos).

A group of copies is one photo to a label-free run (:mod:`training.label_free_data`): held out whole,
one id in the held-out check, one row for k-means and one pseudo-label in training, whatever cluster its
copies' own embeddings would fall in.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.decode.images import ImageDecodeError, load_image_file
from engine.duplicates.groups import components
from engine.duplicates.signature import perceptual_signature
from engine.duplicates.tiers import Tier, find_tiered
from engine.gallery.hashing import file_hash
from foundation import stopping
from foundation.atomic import atomic_path
from foundation.progress import progress_bar
from index.gallery import GalleryIndex
from index.protocol import Entry


def byte_copies(files: Sequence[Path]) -> np.ndarray:
    """Per file, the index of the first file with the same bytes (itself when it has no copy)."""
    first: dict[str, int] = {}
    return np.array([first.setdefault(file_hash(path), index) for index, path in enumerate(files)], np.int64)


def signatures(
    files: Sequence[Path], cache_dir: Path, draft_size: int, *, progress: bool = True
) -> list[bytes]:
    """Each file's perceptual signature (empty for an unreadable file), cached under ``cache_dir`` by the
    files' contents."""
    digest = hashlib.sha256(f"signatures draft={draft_size}".encode())
    for path in files:
        digest.update(f"\n{file_hash(path)}".encode())
    target = cache_dir / "signatures" / f"{digest.hexdigest()[:32]}.npz"
    if target.exists():
        with np.load(target) as cached:
            return [
                row.tobytes() if ok else b"" for row, ok in zip(cached["rows"], cached["ok"], strict=True)
            ]
    found = []
    for path in progress_bar(files, desc="perceptual signatures", unit="img", disable=not progress):
        try:
            found.append(perceptual_signature(load_image_file(path, draft_size=draft_size)))
        except (ImageDecodeError, OSError):
            found.append(b"")  # the feature extraction skips it and says why
        stopping.checkpoint()
    width = max((len(signature) for signature in found), default=0)
    rows = np.zeros((len(found), width), np.uint8)
    for row, signature in zip(rows, found, strict=True):
        row[: len(signature)] = np.frombuffer(signature, np.uint8)
    with atomic_path(target) as temporary, temporary.open("wb") as handle:
        np.savez(handle, rows=rows, ok=np.array([bool(signature) for signature in found]))
    return found


def copy_groups(
    files: Sequence[Path], embeddings: np.ndarray, readable: np.ndarray, signed: list[bytes], tier: Tier
) -> np.ndarray:
    """Per file, the index of the first file of its group of copies (itself when it has none): byte copies
    and the groups of the finder's ``tier`` (EXACT: bytes or decoded pixels; EDITED: edited copies too; never
    SIMILAR, a second take being another photo) among the ``readable`` files, from their
    ``embeddings`` (n, d) and signatures ``signed``."""
    by_bytes = byte_copies(files)
    firsts, seconds = [np.arange(len(files))], [by_bytes]
    rows = np.flatnonzero(readable)
    if len(rows) > 1:
        with tempfile.TemporaryDirectory(prefix="copies-") as work:
            index = GalleryIndex.create(
                Path(work), dim=embeddings.shape[1], model_fingerprint="label-free copies", gallery_root=None
            )
            ids = index.add(
                np.ascontiguousarray(embeddings[rows], dtype=np.float32),
                [Entry(str(row), None, file_hash(files[row])) for row in rows.tolist()],
                [signed[row] or None for row in rows.tolist()],
            )
            index.save()  # builds the search index the finder's kNN pairs need
            row_of = dict(zip(ids, rows.tolist(), strict=True))
            for group in find_tiered(index, tier).groups:
                members = np.array([row_of[int(i)] for i in group.ids], np.int64)
                firsts.append(members)
                seconds.append(np.full(len(members), members.min()))
            index.close()
    component = components(len(files), np.concatenate(firsts), np.concatenate(seconds))
    first_of = np.full(len(files), len(files), np.int64)
    np.minimum.at(first_of, component, np.arange(len(files)))
    return first_of[component]
