"""Combine the FAISS shard directories of one gallery (``build-index --shard I/N``) into one index.

Items are copied in sorted path order, content duplicates across shards keep the first path, so ids come
out exactly as a single-process build of the whole gallery gives them. The FAISS index is trained once on
a sample of all vectors; each shard's vectors fill their own copy of the trained index and the parts are
merged with faiss's IVF merge (``faiss.merge_into``), as faiss's recipe for building in pieces does.

Merging into an index directory that holds an index keeps that index's judgments, on the items of the
same content (ids may differ); shards hold none (a shard is never served).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, closing
from pathlib import Path

import numpy as np

from foundation.errors import InvalidInputError
from foundation.progress import progress_bar
from index.backends import capabilities_of
from index.gallery import GalleryIndex, ModelWriter
from index.judgments import carry
from index.manifest import MANIFEST_NAME, Manifest
from index.protocol import Entry, Item
from index.selection import IndexOptions
from index.sharding import Shard
from index.staging import staged_write

COPY_CHUNK = 4096


def _check_shards(manifests: Sequence[Manifest], directories: Sequence[Path]) -> None:
    first = manifests[0]
    shards = []
    for manifest, directory in zip(manifests, directories, strict=True):
        if not capabilities_of(manifest.backend).mergeable:
            raise InvalidInputError(
                f"{directory} is a {manifest.backend} index: only FAISS shard directories merge"
            )
        if manifest.shard is None:
            raise InvalidInputError(f"{directory} is not a shard (build it with --shard I/N)")
        if (manifest.model_fingerprint, manifest.dim) != (first.model_fingerprint, first.dim):
            raise InvalidInputError(f"{directory} was built with another model than {directories[0]}")
        if manifest.gallery_root != first.gallery_root:
            raise InvalidInputError(f"{directory} indexes {manifest.gallery_root}, not {first.gallery_root}")
        shards.append(Shard.parse(manifest.shard))
    count = shards[0].count
    if sorted(shard.index for shard in shards) != list(range(count)) or any(s.count != count for s in shards):
        got = ", ".join(str(shard) for shard in shards)
        raise InvalidInputError(f"need each shard I/{count} for I = 0 .. {count - 1} exactly once, got {got}")


def merge_shards(
    shard_dirs: Sequence[Path],
    out_dir: Path,
    *,
    options: IndexOptions | None = None,
    model: ModelWriter | None = None,
    progress: bool = True,
) -> GalleryIndex:
    """Write the merged index to ``out_dir`` (one staged write: ``index.staging``), storing ``model`` in
    it (None: the shards carry none), and return it opened."""
    if not shard_dirs:
        raise InvalidInputError("no shard directories to merge")
    manifests = [Manifest.load(directory) for directory in shard_dirs]
    _check_shards(manifests, shard_dirs)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).exists():
        raise InvalidInputError(
            f"refusing to write into {out_dir}: it is not empty and not an index directory"
        )
    first = manifests[0]

    def create(staging: Path) -> GalleryIndex:
        return GalleryIndex.create(
            staging,
            dim=first.dim,
            model_fingerprint=first.model_fingerprint,
            gallery_root=Path(first.gallery_root) if first.gallery_root else None,
            options=options or first.options,
        )

    with ExitStack() as sources:
        shards = [
            sources.enter_context(closing(GalleryIndex.open(directory, read_only=True)))
            for directory in shard_dirs
        ]
        # A merge starts afresh each time: copying the shards again is the cheap part of it.
        fingerprint = first.model_fingerprint
        with staged_write(out_dir, fingerprint=fingerprint, create=create, resume=False) as staged:
            partitions = _copy_items(shards, staged.index, progress)
            if (out_dir / MANIFEST_NAME).exists():
                _carry_judgments(out_dir, staged.index)
            staged.commit(model, retune=True, partitions=partitions, progress=progress)
    return GalleryIndex.open(out_dir)


def _carry_judgments(previous_dir: Path, target: GalleryIndex) -> None:
    """Copy the judgments of the index at ``previous_dir`` into ``target``, by the content of their items."""
    new_ids = {item.content_hash: item.id for item in target.items.scan()}
    with closing(GalleryIndex.open(previous_dir, read_only=True)) as previous:
        by_old_id = {
            item.id: new_ids[item.content_hash]
            for item in previous.items.scan()
            if item.content_hash in new_ids
        }
        carry(previous.judgments.scan(), target.judgments, by_old_id, target.manifest.model_fingerprint)


def _copy_items(stores: Sequence[GalleryIndex], target: GalleryIndex, progress: bool) -> list[np.ndarray]:
    """Copy every shard's items and vectors in path order; return the new ids that came from each shard."""
    first_by_content: dict[str, tuple[int, Item]] = {}
    for number, store in enumerate(stores):
        for item in store.items.scan():
            kept = first_by_content.get(item.content_hash)
            if kept is None or item.path < kept[1].path:
                first_by_content[item.content_hash] = (number, item)
    ordered = sorted(first_by_content.values(), key=lambda pair: pair[1].path)
    new_ids: list[list[int]] = [[] for _ in stores]
    bar = progress_bar(total=len(ordered), desc="copying shard items", unit="item", disable=not progress)
    for start in range(0, len(ordered), COPY_CHUNK):
        chunk = ordered[start : start + COPY_CHUNK]
        vectors = np.zeros((len(chunk), target.manifest.dim), dtype=np.float32)
        signatures: list[bytes | None] = [None] * len(chunk)
        for number, store in enumerate(stores):
            positions = [i for i, (owner, _) in enumerate(chunk) if owner == number]
            if positions:
                shard_ids = [chunk[i][1].id for i in positions]
                vectors[positions] = store.vectors(shard_ids)
                stored = store.signatures(shard_ids)
                for position, shard_id in zip(positions, shard_ids, strict=True):
                    signatures[position] = stored.get(shard_id)
        ids = target.copy_in(
            vectors,
            [Entry(item.path, item.label, item.content_hash, item.taken) for _, item in chunk],
            signatures,
            added=[item.added for _, item in chunk],
        )
        for (number, _), new_id in zip(chunk, ids, strict=True):
            new_ids[number].append(new_id)
        bar.update(len(chunk))
    bar.close()
    return [np.array(ids, dtype=np.int64) for ids in new_ids if ids]
