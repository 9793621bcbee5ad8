"""The gallery folder that the processes writing to one index share.

A Milvus collection's vectors are shared by every replica serving it, and by every ``build-index`` into
it; its photos must be too: an upload (``POST /v1/items``) is written into the replica's gallery folder and
a delete sets the photo aside there, so replicas whose folders differ diverge, and a rebuild from either
folder loses what the other wrote. The one supported set-up is one folder that every replica sees (a shared
mount). It is checked, not assumed: the folder carries a mark (``GALLERY_MARK``: a random id, written
once, never changed), the collection records the mark of its folder, and a process writes into the folder
only while the two agree. A replica given another folder, a copy started empty, or a mount point whose
share is not mounted has no mark or another one, and is refused: at start (not ready, with the reason), at
each write (503), and ``build-index`` of another folder into the collection (unless ``--replace``).

A collection that records no mark yet (built before marks) takes that of the first folder that writes to it;
should two replicas with different folders race to give it theirs, one of them loses, and it finds out at
its next check. A copy of the folder that carries the mark file is taken for the folder: copy the photos,
not ``GALLERY_MARK``. An index that lives in its folder (FAISS) is written by one process: nothing to check.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from foundation.defaults import GALLERY_MARK
from foundation.errors import DmlsearchError, ErrorKind
from foundation.regular_files import read_regular
from index.gallery import GalleryIndex

MARK_BYTES = 256  # a mark is 32 hex digits: anything longer is not one


class GalleryNotSharedError(DmlsearchError, RuntimeError):
    """The gallery folder is not the one the index's other writers share: writing there would diverge."""

    kind = ErrorKind.UNAVAILABLE
    code = "gallery_not_shared"


def folder_mark(root: Path, *, create: bool) -> str | None:
    """The mark of the gallery folder ``root`` (None: it has none); ``create``: give it one if it has none
    (exclusively: two processes marking the folder at once agree on one mark), unless the folder cannot be
    written (None: nothing can be uploaded into it either)."""
    path = root / GALLERY_MARK
    try:
        return _read_mark(path)
    except FileNotFoundError:
        if not create:
            return None
    mark = secrets.token_hex(16)
    # Written aside, then linked in: the link is exclusive and the file whole, so a process marking the
    # folder at the same moment never reads a mark file created but not yet written (an empty mark).
    staged = root / f".{GALLERY_MARK}.{mark}"
    try:
        _write_synced(staged, mark)
    except OSError:  # a read-only folder (or share): its writes fail on their own, with nothing written
        return None
    try:
        os.link(staged, path)
    except FileExistsError:  # another process marked it meanwhile: its mark
        return _read_mark(path)
    except OSError:  # a file system without hard links (an object-store mount): created in place
        return _mark_in_place(path, mark)
    finally:
        staged.unlink(missing_ok=True)
    return mark


def _mark_in_place(path: Path, mark: str) -> str | None:
    """``mark`` written straight into ``path`` unless it exists; a process marking the folder at the same
    moment may read it empty (no mark) and finds the mark at its next check."""
    try:
        _write_synced(path, mark)
    except FileExistsError:
        return _read_mark(path)
    except OSError:
        return None
    return mark


def _read_mark(path: Path) -> str | None:
    return read_regular(path, MARK_BYTES).decode().strip() or None


def _write_synced(path: Path, mark: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(descriptor, f"{mark}\n".encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def require_shared_gallery(index: GalleryIndex) -> None:
    """Refuse (:class:`GalleryNotSharedError`) to write into the gallery folder of ``index`` unless it
    carries the mark the index records; an index that records none takes the folder's (marking the folder
    first if need be). Nothing to check for an index that lives in its folder, or that has no gallery."""
    root = index.manifest.gallery_root
    if index.capabilities.lives_in_folder or root is None:
        return
    folder = Path(root)
    recorded = index.gallery_mark()
    if recorded is None:
        mark = folder_mark(folder, create=True)
        if mark is None:  # a folder that cannot be written: no write will land in it
            return
        index.record_gallery_mark(mark)
        recorded = index.gallery_mark()  # a replica that raced to record its own folder's may have won
    mark = folder_mark(folder, create=False)
    if mark != recorded:
        raise GalleryNotSharedError(_refusal(folder, mark, "its other replicas write to"))


def mark_built_gallery(index: GalleryIndex, folder: Path, *, replace: bool) -> None:
    """``build-index`` of ``folder`` into ``index``: record the folder's mark where the index records none
    (or ``replace`` repoints it), refuse a folder whose mark is not the recorded one (a build from it would
    remove the items its other writers added)."""
    if index.capabilities.lives_in_folder:
        return
    recorded = index.gallery_mark()
    if recorded is None or replace:
        mark = folder_mark(folder, create=True)
        if mark is not None and mark != recorded:  # None: a read-only folder, which takes no uploads
            index.record_gallery_mark(mark)
        return
    mark = folder_mark(folder, create=False)
    if mark != recorded:
        raise GalleryNotSharedError(
            _refusal(folder, mark, "it was built from")
            + "; a build from it would remove the items added through the others (give --replace to repoint "
            "the collection at this folder)"
        )


def _refusal(folder: Path, mark: str | None, whose: str) -> str:
    found = f"carries another mark ({mark[:12]})" if mark else f"has no {GALLERY_MARK} mark"
    return (
        f"the gallery folder {folder} is not the one the index's collection is shared with ({found}): its "
        f"photos must be the folder {whose}, mounted at this path on every replica"
    )
