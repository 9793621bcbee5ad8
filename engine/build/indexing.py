"""Embed a folder of images into an index directory, incrementally.

Re-running on the same folder embeds only new or changed files (by content hash) and removes the items
whose files are gone. Every embedded batch is committed to the index's store at once, so an interrupted
build resumes where it stopped. Files with identical content are indexed once (the first path in sorted
order). With a shard ``I/N`` only the files whose path hashes to shard I are handled, so N processes or
machines share one gallery (FAISS shard directories are then combined by ``index.merge``).
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from engine.build.prefetch import WORKER_NICENESS, DecodedFile, decode_file, prefetch
from engine.decode.capture_time import photo_time
from engine.decode.pool import DecodePool
from engine.gallery.files import list_images, resolves_inside
from engine.model.bundle import model_writer
from engine.model.embedder import Embedder
from foundation import stopping
from foundation.defaults import BATCH_SIZE, DECODE_WORKERS
from foundation.errors import DmlsearchError, ErrorKind, InvalidInputError
from foundation.families import Backend
from index.gallery import GalleryIndex
from index.manifest import MANIFEST_NAME, Manifest
from index.protocol import Entry, Item, Move
from index.selection import IndexChanges, IndexOptions
from index.sharding import Shard
from index.staging import remove_leftover, staged_write


@dataclass(frozen=True)
class MovedFile:
    """An item whose file was renamed or moved: it keeps its id and vector under the new path and label."""

    old_path: str
    new_path: str
    old_label: str | None
    new_label: str | None


@dataclass
class BuildReport:
    indexed: int = 0  # files embedded and added by this run
    unchanged: int = 0  # files already indexed with the same content
    removed: int = 0  # items whose file is gone or changed
    moved: int = 0  # items whose file was renamed or moved (same content: same id, not re-embedded)
    moves: list[MovedFile] = field(default_factory=list)  # which, with their labels before and after
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (relative path, path it duplicates)
    dated: int = 0  # items indexed before capture times were kept that now have theirs
    rebuilt: bool = False  # whether the search index was (re)built rather than updated in place
    # Items re-embedded under their ids because the index was built with another model, and that model.
    reembedded: int = 0
    previous_model: str | None = None


@dataclass(frozen=True)
class GalleryFile:
    path: Path
    relative: str
    label: str | None
    content_hash: str


@dataclass
class SyncPlan:
    embed: list[GalleryFile] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    moved_files: list[MovedFile] = field(default_factory=list)  # the moves, as a report names them
    unchanged: int = 0
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    undated: dict[int, Path] = field(default_factory=dict)  # kept items without a capture time: their files


# How a runner hashes files: ``(path, content hash or the error that made the file unreadable)``, any order.
Hasher = Callable[[list[Path]], Iterable[tuple[Path, str | Exception]]]


def hash_files(
    root: Path,
    files: Sequence[Path],
    report: BuildReport,
    progress: bool,
    *,
    workers: int = DECODE_WORKERS,
    hasher: Hasher | None = None,
) -> list[GalleryFile]:
    """Content hashes of ``files``, sorted by relative path; unreadable files go to ``report.skipped``.

    So do links to files outside the gallery folder: the server refuses to serve such files (a link
    could expose anything on the machine), so they would show in results as images that cannot be shown.
    """
    hashed = []
    inside = []
    for path in files:
        if resolves_inside(path, root):
            inside.append(path)
        else:
            relative = path.relative_to(root).as_posix()
            report.skipped.append((relative, f"links outside the gallery folder (to {path.resolve()})"))
    # On ``workers`` threads (hashlib and file reads release the GIL), as the model waits for every hash
    # before it embeds the first file: the plan needs them all. Or by ``hasher`` (a cluster's workers).
    hashes: Iterable[tuple[Path, str | Exception]]
    if hasher is None:
        hashes = prefetch(inside, file_hash, workers=workers, depth=2 * max(workers, 1))
    else:
        hashes = hasher(inside)
    for path, content_hash in tqdm(
        hashes, total=len(inside), desc="hashing", unit="file", disable=not progress
    ):
        relative = path.relative_to(root).as_posix()
        if isinstance(content_hash, Exception):
            report.skipped.append((relative, str(content_hash)))
            continue
        hashed.append(GalleryFile(path, relative, label_of(relative), content_hash))
    return sorted(hashed, key=lambda f: f.relative)


def label_of(relative: str) -> str | None:
    """A gallery file's label: the name of its folder (None for a file at the top of the gallery)."""
    return Path(relative).parent.name or None


def file_hash(path: Path) -> str:
    with path.open("rb") as file:  # in chunks: no copy of a whole 12-MP photo in memory
        return hashlib.file_digest(file, "sha256").hexdigest()


def plan_sync(
    files: Sequence[GalleryFile], stored: Iterable[Item], *, gone: Callable[[str], bool]
) -> SyncPlan:
    """What to embed, move and remove so the stored items match ``files``.

    An item is kept when its path still holds the same content; a changed file is removed and embedded
    again. An item whose path is not among ``files`` and whose file is ``gone`` has moved when one of
    ``files`` holds its content (it keeps its id and vector under the new path), and is removed otherwise.
    Content already indexed is reported as a duplicate instead of being embedded twice; among new files of
    one content, a file in a label folder is indexed before one without a label (a stray `IMG_3 copy.jpg`
    beside the folders must not take the labelled photo's place), then the first in path order. Kept items
    indexed before capture times were kept are listed to be dated.
    """
    plan = SyncPlan()
    current = {f.relative: f.content_hash for f in files}
    paths = {f.relative: f.path for f in files}
    first_path: dict[str, str] = {}  # content hash -> the path that holds it in the index
    kept: set[str] = set()
    moved_away: dict[str, list[Item]] = {}  # content hash -> items whose file is gone
    for item in stored:
        content = current.get(item.path)
        if content == item.content_hash:
            kept.add(item.path)
            first_path.setdefault(item.content_hash, item.path)
            if item.taken is None:
                plan.undated[item.id] = paths[item.path]
        elif content is not None:
            plan.remove.append(item.id)
        elif gone(item.path):
            moved_away.setdefault(item.content_hash, []).append(item)
        else:  # not part of this sync and still on disk
            first_path.setdefault(item.content_hash, item.path)
    for gallery_file in sorted(files, key=lambda f: (f.label is None, f.relative)):
        content_hash = gallery_file.content_hash
        if gallery_file.relative in kept:
            plan.unchanged += 1
        elif content_hash in first_path:
            plan.duplicates.append((gallery_file.relative, first_path[content_hash]))
        elif moved_away.get(content_hash):
            item = moved_away[content_hash].pop(0)
            plan.moves.append(Move(item.id, gallery_file.relative, gallery_file.label))
            plan.moved_files.append(
                MovedFile(item.path, gallery_file.relative, item.label, gallery_file.label)
            )
            first_path[content_hash] = gallery_file.relative
        else:
            first_path[content_hash] = gallery_file.relative
            plan.embed.append(gallery_file)
    plan.remove.extend(item.id for items in moved_away.values() for item in items)
    plan.embed.sort(key=lambda f: f.relative)  # ids follow path order, whatever the preference above
    return plan


class ItemSink(Protocol):
    """Where embedded files go: an index, or a writer that keeps the ids of the items it re-embeds."""

    def add(self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes]) -> object: ...


class EmbeddingRunner(Protocol):
    """Where a build hashes, decodes and embeds its files: this process (:class:`LocalRunner`) or a Ray
    cluster (``engine.build.ray_runner.RayRunner``). The plan (what to embed, move, remove) is made here
    either way.
    """

    def hash_files(
        self, root: Path, files: Sequence[Path], report: BuildReport, progress: bool
    ) -> list[GalleryFile]: ...

    def embed_files(
        self,
        index: ItemSink,
        embedder: Embedder,
        files: Sequence[GalleryFile],
        report: BuildReport,
        *,
        batch_size: int,
        progress: bool,
    ) -> None: ...


@dataclass(frozen=True)
class LocalRunner:
    """Hashing on threads, decoding in ``decode_workers`` processes, embedding in this process."""

    decode_workers: int = DECODE_WORKERS

    def hash_files(
        self, root: Path, files: Sequence[Path], report: BuildReport, progress: bool
    ) -> list[GalleryFile]:
        return hash_files(root, files, report, progress, workers=self.decode_workers)

    def embed_files(
        self,
        index: ItemSink,
        embedder: Embedder,
        files: Sequence[GalleryFile],
        report: BuildReport,
        *,
        batch_size: int,
        progress: bool,
    ) -> None:
        embed_files(
            index,
            embedder,
            files,
            report,
            batch_size=batch_size,
            progress=progress,
            decode_workers=self.decode_workers,
        )


def embed_files(
    index: ItemSink,
    embedder: Embedder,
    files: Sequence[GalleryFile],
    report: BuildReport,
    *,
    batch_size: int,
    progress: bool,
    decode_workers: int = DECODE_WORKERS,
) -> None:
    """Decode, embed and add ``files`` batch by batch; each batch is durable once added, and a stop signal
    (``foundation.stopping``) ends the work there.

    ``decode_workers`` processes (``engine.decode.pool``: a file over its time or memory limit is skipped,
    with the reason) decode and preprocess the next batches (and compute their perceptual signatures)
    while the model embeds this one.
    """
    preprocessing = embedder.card.preprocessing
    batch: list[tuple[GalleryFile, DecodedFile]] = []

    def flush(committer: BatchCommitter) -> None:
        vectors = embedder.embed_tensor(np.stack([decoded.array for _, decoded in batch]))
        committer.add(
            vectors,
            [Entry(f.relative, f.label, f.content_hash, decoded.taken) for f, decoded in batch],
            [decoded.signature for _, decoded in batch],
        )
        batch.clear()
        stopping.checkpoint()  # a stop waits for the batch being committed: nothing embedded is lost

    # Two batches in flight: the next one is complete when the model finishes this one. One thread per
    # decode process waits for it.
    pool = DecodePool(max(decode_workers, 1), niceness=WORKER_NICENESS)
    loaded = prefetch(
        files,
        lambda f: pool.run(decode_file, f.path, preprocessing),
        workers=decode_workers,
        depth=2 * batch_size,
    )
    with pool, BatchCommitter(index, report) as committer:
        for gallery_file, result in tqdm(
            loaded, total=len(files), desc="embedding", unit="img", disable=not progress
        ):
            if isinstance(result, Exception):
                report.skipped.append((gallery_file.relative, str(result)))
                continue
            batch.append((gallery_file, result))
            if len(batch) == batch_size:
                flush(committer)
        if batch:
            flush(committer)


class BatchCommitter:
    """Adds embedded batches to an :class:`ItemSink` on a writer thread, one at a time and in order, so
    that the model embeds the next batch while this one is committed (SQLite's fsync took 20-40 ms a
    batch here, a tenth of the model's time on a batch of 32 224-px images).

    A batch counts in ``report.indexed`` once its commit has returned; leaving the ``with`` block (also
    on an error or a stop) waits for the batch being committed, so an interrupted build loses at most the
    batch the model was embedding, as when batches were committed inline.
    """

    def __init__(self, sink: ItemSink, report: BuildReport) -> None:
        self.sink = sink
        self.report = report
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self._committing: tuple[Future[object], int] | None = None

    def add(self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes]) -> None:
        """Commit a batch once the one before it is committed (raising that one's error, if it failed)."""
        self.wait()
        self._committing = (
            self._writer.submit(self.sink.add, vectors, entries, signatures),
            len(entries),
        )

    def wait(self) -> None:
        if self._committing is not None:
            future, count = self._committing
            self._committing = None
            future.result()
            self.report.indexed += count

    def __enter__(self) -> BatchCommitter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown()


def sync_files(
    index: GalleryIndex,
    root: Path,
    files: Sequence[Path],
    embedder: Embedder,
    report: BuildReport,
    *,
    gone: Callable[[str], bool],
    shard: Shard | None = None,
    batch_size: int,
    progress: bool,
    decode_workers: int = DECODE_WORKERS,
    runner: EmbeddingRunner | None = None,
) -> SyncPlan:
    """Bring the items of ``files`` (and of the stored items whose file is ``gone``) up to date in ``index``.

    The index is changed but not rebuilt or saved: the caller does both. ``runner``: where files are hashed
    and embedded (default: this process, with ``decode_workers``).
    """
    runner = runner or LocalRunner(decode_workers)
    hashed = runner.hash_files(root, files, report, progress)
    stored = (item for item in index.items.scan() if shard is None or shard.owns(item.path))
    plan = plan_sync(hashed, stored, gone=gone)
    report.unchanged, report.duplicates = plan.unchanged, plan.duplicates
    if plan.remove:
        report.removed = index.remove(plan.remove)
    if plan.moves:
        report.moved = index.move(plan.moves)
        report.moves = plan.moved_files
    if plan.undated:  # an index from before capture times were kept: read them from the headers, once
        report.dated = index.set_taken({item_id: photo_time(path) for item_id, path in plan.undated.items()})
    runner.embed_files(index, embedder, plan.embed, report, batch_size=batch_size, progress=progress)
    return plan


def _check_kind(directory: Path, manifest: Manifest, backend: str | None, shard: Shard | None) -> None:
    """Refuse to bring an index up to date as another backend or another shard than it holds."""
    if backend is not None and backend != manifest.backend:
        raise InvalidInputError(
            f"{directory} is a {manifest.backend} index: build a {backend} index into another directory"
        )
    if manifest.shard != (str(shard) if shard else None):
        raise InvalidInputError(
            f"{directory} holds shard {manifest.shard or 'none (a whole gallery)'}, "
            f"not {shard or 'the whole gallery'}"
        )


class GalleryMismatchError(DmlsearchError, ValueError):
    """The index was built from another gallery folder, and taking it over was not asked for."""

    kind = ErrorKind.CONFLICT
    code = "gallery_mismatch"


def _check_gallery(out_dir: Path, manifest: Manifest, gallery_root: Path, files: Sequence[Path]) -> None:
    """Refuse to repoint an index at another folder than the one it was built from: the items not found
    at the same paths there would be removed (``make demo`` once emptied a user's index this way)."""
    old, new = manifest.gallery_root, gallery_root.resolve()
    if old is None or Path(old) == new:
        return
    if manifest.backend == "faiss":
        listed = {path.relative_to(gallery_root).as_posix() for path in files}
        stored = GalleryIndex.open(out_dir, read_only=True)
        try:
            paths = [item.path for item in stored.items.scan()]
        finally:
            stored.close()
        lost = sum(path not in listed for path in paths)
        what = f"{lost} of its {len(paths)} items are not at the same paths under {new} and would be removed"
    else:
        what = f"its {manifest.count} items would be removed unless found at the same paths under {new}"
    raise GalleryMismatchError(
        f"{out_dir} indexes the folder {old}, not {new}: {what}. Index {new} into another directory, or "
        "give build-index --replace to repoint this index at it"
    )


@dataclass(frozen=True)
class _Gallery:
    """What one ``build-index`` run brings an index up to date with, and how."""

    root: Path
    files: list[Path]
    embedder: Embedder
    shard: Shard | None
    batch_size: int
    progress: bool
    decode_workers: int
    runner: EmbeddingRunner | None

    def sync(self, index: GalleryIndex, report: BuildReport) -> bool:
        """Bring ``index`` up to date with the folder (not built or saved); returns whether items changed.

        Raises when nothing could be indexed: from what this run did, not from the index's count (a
        server's count may lag its writes, and a server's failure is raised as what it is, never taken
        for undecodable files)."""
        plan = sync_files(
            index,
            self.root,
            self.files,
            self.embedder,
            report,
            gone=lambda _: True,  # every file of the gallery was listed: the others are gone
            shard=self.shard,
            batch_size=self.batch_size,
            progress=self.progress,
            decode_workers=self.decode_workers,
            runner=self.runner,
        )
        if report.indexed + plan.unchanged + len(plan.moves) == 0:
            raise NothingDecodedError(
                f"none of the {len(self.files)} files under {self.root} could be decoded"
            )
        return bool(plan.remove or report.indexed)


class NothingDecodedError(DmlsearchError, ValueError):
    """Not one file of the gallery could be read and decoded."""

    code = "nothing_decoded"


def build_index(
    gallery_root: Path,
    embedder: Embedder,
    out_dir: Path,
    *,
    replace: bool = False,
    batch_size: int = BATCH_SIZE,
    progress: bool = True,
    changes: IndexChanges = IndexChanges(),
    backend: str | None = None,
    milvus_uri: str | None = None,
    milvus_collection: str | None = None,
    shard: Shard | None = None,
    decode_workers: int = DECODE_WORKERS,
    runner: EmbeddingRunner | None = None,
) -> BuildReport:
    """Make the index at ``out_dir`` match the images below ``gallery_root`` (or its shard of them).

    ``changes`` to the index options, and a backend not given, keep what an existing index was built
    with (a new index starts from ``IndexOptions()``'s defaults and the faiss backend). The index stores
    the embedder's model (``engine.model.bundle``). An index built from another folder is refused
    (:class:`GalleryMismatchError`) unless ``replace``.
    An index built with another model is rebuilt aside and swapped in when complete (``index.staging``):
    a FAISS index's items are re-embedded under their ids first (``engine.build.rebuild``), then brought up to
    date with the folder. Unreadable files are skipped and listed in the report. ``runner``: where files
    are hashed, decoded and embedded (default: this process, with ``decode_workers``; a re-embedding for
    another model stays here).
    """
    files = list_images(gallery_root)
    if shard is not None:
        files = [p for p in files if shard.owns(p.relative_to(gallery_root).as_posix())]
    if not files:
        where = f"in shard {shard} of" if shard else "under"
        raise InvalidInputError(f"no images {where} {gallery_root}")
    out_dir = out_dir.resolve()
    gallery = _Gallery(gallery_root, files, embedder, shard, batch_size, progress, decode_workers, runner)
    report = BuildReport()
    if not (out_dir / MANIFEST_NAME).exists():
        if out_dir.exists() and any(out_dir.iterdir()):
            raise InvalidInputError(
                f"refusing to write into {out_dir}: it is not empty and not an index directory"
            )

        def create(staging: Path) -> GalleryIndex:
            return GalleryIndex.create(
                staging,
                dim=embedder.dim,
                model_fingerprint=embedder.fingerprint,
                gallery_root=gallery_root,
                options=IndexOptions().with_changes(changes),
                backend=backend or "faiss",
                milvus_uri=milvus_uri,
                milvus_collection=milvus_collection,
                shard=str(shard) if shard else None,
            )

        if backend == Backend.MILVUS:
            # Its vectors live in the Milvus server at a URI the user gave (milvus-lite's file may lie
            # inside out_dir, held open): the directory cannot be written aside and swapped in whole.
            _fill_in_place(create(out_dir), gallery, report)
        else:
            _build_new(out_dir, create, gallery, report, backend=backend, changes=changes, replace=replace)
        return report
    manifest = Manifest.load(out_dir)
    if not replace:
        _check_gallery(out_dir, manifest, gallery_root, files)
    _check_kind(out_dir, manifest, backend, shard)
    remove_leftover(out_dir)  # the old index, when a kill came right after the last staged write's exchange
    options = manifest.options.with_changes(changes) if changes else None  # None: what the index has
    if (manifest.model_fingerprint, manifest.dim) != (embedder.fingerprint, embedder.dim):
        _build_for_new_model(out_dir, manifest, gallery, report, options)
        return report
    index = GalleryIndex.open(out_dir, milvus_uri=milvus_uri)
    try:
        index.set_gallery_root(gallery_root)
        changed = gallery.sync(index, report) or options is not None
        report.rebuilt = index.build(options, retune=changed, progress=progress)
        index.store_model(model_writer(embedder.model_path))
        index.save()
    finally:
        index.close()
    return report


def _fill_in_place(index: GalleryIndex, gallery: _Gallery, report: BuildReport) -> None:
    """Fill a new Milvus index in place. Its model is stored before its first item, so the directory never
    holds vectors without the model that embedded them; an interrupted build is an index with fewer items,
    which the rerun completes."""
    discard = False
    try:
        index.store_model(model_writer(gallery.embedder.model_path))
        index.save()
        gallery.sync(index, report)
        report.rebuilt = index.build(retune=True, progress=gallery.progress)
        index.save()
    except NothingDecodedError:
        discard = True  # leave no empty index behind
        raise
    finally:
        index.close()
        if discard:
            shutil.rmtree(index.directory)


def _build_new(
    out_dir: Path,
    create: Callable[[Path], GalleryIndex],
    gallery: _Gallery,
    report: BuildReport,
    *,
    backend: str | None,
    changes: IndexChanges,
    replace: bool,
) -> None:
    """Write a new index aside and swap it in with its model (``index.staging``): ``out_dir`` holds no
    index until it is complete. An interrupted build continues in the staging copy, checked and updated as
    the index at ``out_dir`` would be (the same folder unless ``replace``, the same backend and shard,
    ``changes`` to its options)."""
    with staged_write(out_dir, fingerprint=gallery.embedder.fingerprint, create=create) as staged:
        manifest = staged.index.manifest
        if not replace:
            _check_gallery(staged.directory, manifest, gallery.root, gallery.files)
        _check_kind(staged.directory, manifest, backend, gallery.shard)
        staged.index.set_gallery_root(gallery.root)
        options = manifest.options.with_changes(changes) if changes else None
        try:
            gallery.sync(staged.index, report)
        except NothingDecodedError:
            staged.discard()  # leave no empty index behind
            raise
        report.rebuilt = staged.commit(
            model_writer(gallery.embedder.model_path), options=options, retune=True, progress=gallery.progress
        )


def _build_for_new_model(
    out_dir: Path, manifest: Manifest, gallery: _Gallery, report: BuildReport, options: IndexOptions | None
) -> None:
    """Write the index for ``gallery.embedder`` aside and swap it in with its model (``index.staging``).

    The items of ``out_dir`` (built with another model) are re-embedded first under their ids, labels and
    times added, as ``dmlsearch index rebuild`` does, so that ids held by clients stay valid; files renamed
    or moved since keep theirs too. A shard or an empty index is built afresh instead. The staging copy is
    saved once re-embedded (its count says so), so a killed run re-embeds nothing again. ``options``:
    changed index options (None: the old index's)."""
    from engine.build.rebuild import (  # engine.build.rebuild builds on this module's embedding
        read_source,
        reembed,
    )

    if manifest.backend == "milvus":
        raise InvalidInputError(
            f"{out_dir} was built with another model and its Milvus collection holds those vectors: "
            "build into a new directory and collection"
        )
    embedder = gallery.embedder
    report.previous_model = manifest.model_fingerprint
    afresh = manifest.shard is not None or manifest.count == 0

    def create(staging: Path) -> GalleryIndex:
        return GalleryIndex.create(
            staging,
            dim=embedder.dim,
            model_fingerprint=embedder.fingerprint,
            gallery_root=gallery.root,
            options=options or manifest.options,
            shard=manifest.shard,
        )

    with staged_write(out_dir, fingerprint=embedder.fingerprint, create=create) as staged:
        staged.index.set_gallery_root(gallery.root)
        if afresh or staged.index.manifest.count:  # nothing to re-embed, or an interrupted run did it
            report.reembedded = 0 if afresh else staged.index.manifest.count
        else:
            source = read_source(out_dir, gallery.root)
            plan = plan_sync(
                hash_files(gallery.root, gallery.files, BuildReport(), gallery.progress),
                source.items,
                gone=lambda _: True,
            )
            # Files gone or unreadable are not re-embedded here; the sync that follows lists what it skips.
            rebuilt = reembed(
                staged.index,
                source,
                embedder,
                moves=plan.moves,
                batch_size=gallery.batch_size,
                progress=gallery.progress,
            )
            report.reembedded = rebuilt.indexed + rebuilt.unchanged
            report.moved, report.moves = len(plan.moves), plan.moved_files
            staged.index.save()  # the checkpoint a killed run continues from
        changed = gallery.sync(staged.index, report) or options is not None
        report.rebuilt = staged.commit(
            model_writer(embedder.model_path), options=options, retune=changed, progress=gallery.progress
        )


def add_images(
    index_dir: Path,
    embedder: Embedder,
    paths: Sequence[Path],
    *,
    batch_size: int = BATCH_SIZE,
    progress: bool = True,
) -> BuildReport:
    """Add image files (or folders of them) below the index's gallery root to an existing index.

    Files already indexed with the same content are left alone; changed files are re-embedded. The
    index is rebuilt from its stored vectors only if the gallery grew past the size its index type
    was chosen for (see ``index.selection``).
    """
    index = GalleryIndex.open(index_dir)
    try:
        index.check_model(embedder.fingerprint, embedder.dim)
        if index.manifest.gallery_root is None:
            raise InvalidInputError(f"{index_dir} records no gallery folder to add images from")
        root = Path(index.manifest.gallery_root)
        files: list[Path] = []
        for path in paths:
            if not resolves_inside(path, root):
                raise InvalidInputError(
                    f"{path} is outside the index's gallery folder {root}: copy it there first"
                )
            resolved = path.resolve()
            files.extend(list_images(resolved) if resolved.is_dir() else [resolved])
        report = BuildReport()
        sync_files(
            index,
            root,
            files,
            embedder,
            report,
            gone=lambda _: False,  # only the named files are looked at
            batch_size=batch_size,
            progress=progress,
        )
        report.rebuilt = index.build(retune=False, progress=progress)
        index.save()
    finally:
        index.close()
    return report
