"""Embed a folder of images into an index directory, incrementally.

Re-running on the same folder embeds only new or changed files (by content hash) and removes the items
whose files are gone. Every embedded batch is committed to the index's store at once, so an interrupted
build resumes where it stopped. Files with identical content are indexed once, under the path the keeper
rule picks (``engine.build.sync.keep_sources``: the photo in its label folder, not a copy). With a shard
``I/N`` only the files whose path hashes to shard I are handled, so N processes or machines share one
gallery (FAISS shard directories are then combined by ``index.merge``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.build.embedding import EmbeddingRunner, hash_files
from engine.build.rebuild import read_source, reembed
from engine.build.report import BuildReport
from engine.build.sync import plan_sync, sync_files
from engine.gallery.files import list_images, resolves_inside
from engine.gallery.shared import mark_built_gallery
from engine.model.bundle import model_writer
from engine.model.embedder import Embedder
from foundation.defaults import BATCH_SIZE, DECODE_WORKERS
from foundation.errors import DmlsearchError, ErrorKind, InvalidInputError
from foundation.families import Backend
from index.backends import capabilities_of
from index.connection import MilvusConnection
from index.gallery import GalleryIndex
from index.manifest import MANIFEST_NAME, Manifest
from index.selection import IndexChanges, IndexOptions
from index.sharding import Shard
from index.staging import remove_leftover, staged_write


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
    if capabilities_of(manifest.backend).lists_items_cheaply:
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
    milvus: MilvusConnection | None = None,
    shard: Shard | None = None,
    decode_workers: int = DECODE_WORKERS,
    runner: EmbeddingRunner | None = None,
) -> BuildReport:
    """Make the index at ``out_dir`` match the images below ``gallery_root`` (or its shard of them).

    ``changes`` to the index options, and a backend not given, keep what an existing index was built
    with (a new index starts from ``IndexOptions()``'s defaults and the faiss backend); ``milvus``: where a
    new index's collection is to be, or where an existing one's server is now. The index stores
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

        new_backend = Backend(backend or Backend.FAISS)

        def create(staging: Path) -> GalleryIndex:
            return GalleryIndex.create(
                staging,
                dim=embedder.dim,
                model_fingerprint=embedder.fingerprint,
                gallery_root=gallery_root,
                options=IndexOptions().with_changes(changes),
                backend=new_backend,
                milvus=milvus,
                shard=str(shard) if shard else None,
            )

        if capabilities_of(new_backend).lives_in_folder:
            _build_new(out_dir, create, gallery, report, backend=backend, changes=changes, replace=replace)
        else:
            # Its vectors live in a server at an address the user gave (Milvus Lite's file may lie inside
            # out_dir, held open): the directory cannot be written aside and swapped in whole.
            _fill_in_place(create(out_dir), gallery, report)
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
    index = GalleryIndex.open(out_dir, milvus=milvus.server_only() if milvus else None)
    try:
        mark_built_gallery(index, gallery_root, replace=replace)
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
        mark_built_gallery(index, gallery.root, replace=True)  # its replicas write to this folder
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
    if not capabilities_of(manifest.backend).lives_in_folder:
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
