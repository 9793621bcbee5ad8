"""Adding and deleting items of the served index, with their gallery files."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.decode.capture_time import clock_now
from engine.decode.images import FORMAT_SUFFIXES
from engine.decode.model_input import RUN_IMAGES, DecodedUploads, decode_uploads
from engine.duplicates.review import delete_items
from engine.gallery.files import is_writable_folder
from engine.gallery.labels import InvalidLabelError, check_label
from engine.gallery.shared import require_shared_gallery
from engine.serve.item_reader import find_item
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from foundation.atomic import atomic_write_bytes
from foundation.errors import DmlsearchError, ErrorKind, InvalidInputError
from foundation.names import readable_name
from index.filters import label_key
from index.protocol import BackendUnavailableError, Entry, Item


class InvalidItemError(InvalidInputError):
    """An item to add is unacceptable (a bad label, no gallery folder to store it in)."""

    code = "invalid_item"


class DuplicateItemError(DmlsearchError, ValueError):
    """An image whose content is indexed already, under any label: one content is one item (as
    build-index keeps it)."""

    kind = ErrorKind.CONFLICT
    code = "duplicate_item"


class StorageError(DmlsearchError, RuntimeError):
    """The gallery or index folder cannot be written (read-only, full): the server's problem, not the
    client's. Searches go on; the message says what was and was not written."""

    kind = ErrorKind.UNAVAILABLE
    code = "storage_unavailable"


@contextmanager
def _storage(outcome: str) -> Iterator[None]:
    """Turn a failed write of the gallery or the index into a :class:`StorageError` saying ``outcome``.

    Once items.sqlite has committed a change it is durable: a FAISS file not saved after it is brought in
    step from items.sqlite at the next save or start (see ``index.faiss_backend``).
    """
    try:
        yield
    except (OSError, sqlite3.OperationalError) as err:
        raise StorageError(f"{outcome}: the index or gallery folder cannot be written ({err})") from err


@dataclass(frozen=True)
class RemovedItem:
    item: Item
    set_aside: list[str]  # its file and the byte copies of it, moved into the gallery's trash
    plan_id: str | None  # undoes the delete (None: the index records no gallery folder)


@dataclass(frozen=True)
class NewItem:
    data: bytes
    label: str | None = None


@dataclass(frozen=True)
class _NewFile:
    entry: Entry  # what the index is told: the gallery-relative path, label, content hash, capture time
    target: Path
    data: bytes


@dataclass(frozen=True)
class _Embedded:
    decoded: DecodedUploads
    vectors: np.ndarray


@dataclass(frozen=True)
class _Prepared:
    files: list[_NewFile]
    vectors: np.ndarray
    signatures: list[bytes]


class ItemWriter:
    """Writes run alone under the bundle's lock (searches wait for them) and save the index before
    returning."""

    def __init__(self, current: CurrentBundle, config: ServingConfig) -> None:
        self.current = current
        self.config = config

    def add(self, new_items: Sequence[NewItem]) -> list[Item]:
        """Store the images under the gallery root (``<label>/<content hash>.<ext>``) and index them.

        Everything is validated, decoded and embedded before the index is touched, so a bad image leaves
        the index unchanged; the decode and embedding run outside the lock (again under it if a reload
        swapped in another model meanwhile), the labels and files are placed under it. Files are written
        atomically; the index is saved before returning.

        Where the index server fails (:class:`BackendUnavailableError`, a 503), its message says the
        outcome: during the insert it is unknown (the server may have stored them before its answer was
        lost), the files are kept and the same upload sent again settles it; during the save that follows,
        the items were stored.
        """
        bundle = self.current.bundle
        embedded = self._embed(bundle, new_items)
        with self.current.writing() as served:
            require_shared_gallery(served.index)  # the folder every replica writes to, or none
            if served.embedder.fingerprint != bundle.embedder.fingerprint:
                embedded = self._embed(served, new_items)
            # Placed under the lock: a reload may have closed the catalog of the bundle embedded for.
            prepared = self._place(served, new_items, embedded)
            for position, file in enumerate(prepared.files):
                known = served.index.items.get_by_content(file.entry.content_hash)
                if known is not None:
                    raise DuplicateItemError(
                        f"image {position} is already indexed, as item {known.id} "
                        f"({readable_name(known.path)}, label {known.label!r}): one content is one item"
                    )
            written = []
            try:
                with _storage("nothing was added"):
                    for file in prepared.files:
                        if not file.target.exists():
                            atomic_write_bytes(file.target, file.data)
                            written.append(file.target)
                    ids = served.index.add(
                        prepared.vectors,
                        [file.entry for file in prepared.files],
                        prepared.signatures,
                    )
            except BackendUnavailableError as err:
                # The index server may have stored them before its answer was lost (a call past its
                # deadline): the files stay, so that no stored item lacks its photo.
                raise BackendUnavailableError(
                    f"{err}; whether the images were stored is unknown: their files are kept in the gallery, "
                    "and sending them again adds them or answers 409 duplicate_item with the item stored"
                ) from err
            except BaseException:
                for target in written:  # files of items that never made it into the index
                    target.unlink(missing_ok=True)
                raise
            stored = f"items {ids} were stored and are searchable, but"
            with _storage(f"{stored} the index files were not saved"):
                try:
                    served.index.save()
                except BackendUnavailableError as err:
                    raise BackendUnavailableError(
                        f"{stored} the index server did not confirm saving them: {err}"
                    ) from err
            return [find_item(served, item_id) for item_id in ids]

    def _embed(self, bundle: LoadedBundle, new_items: Sequence[NewItem]) -> _Embedded:
        """Check, decode and embed the new items with ``bundle``'s model (the slow part: outside the lock)."""
        decoded = self.config.decoder.run(
            decode_uploads,
            [new.data for new in new_items],
            self.config.budget(bundle.embedder),
            bundle.embedder.card.preprocessing,
            signatures=True,
            capture_times=True,
            images=len(new_items),
        )
        return _Embedded(decoded, bundle.embedder.embed_tensor(decoded.tensor, run_size=RUN_IMAGES))

    def _place(self, bundle: LoadedBundle, new_items: Sequence[NewItem], embedded: _Embedded) -> _Prepared:
        """Where each new item's file goes in ``bundle``'s gallery, under which label."""
        root = _gallery_root(bundle)
        decoded = embedded.decoded
        assert decoded.capture_times is not None  # asked for by _embed
        files: list[_NewFile] = []
        stored_labels = list(bundle.index.items.label_counts())
        for position, (new, image_format) in enumerate(zip(new_items, decoded.formats, strict=True)):
            label = _label_folder(bundle, root, new.label, position, stored_labels)
            digest = hashlib.sha256(new.data).hexdigest()
            relative = Path(label or ".") / f"{digest[:20]}{FORMAT_SUFFIXES[image_format]}"
            target = root / relative
            if target.exists() and (not target.is_file() or target.read_bytes() != new.data):
                raise InvalidItemError(f"image {position}: {relative} already holds another file")
            if any(digest == earlier.entry.content_hash for earlier in files):
                raise DuplicateItemError(f"image {position} repeats an earlier image of this request")
            # The photo's capture time (read from its header in the decode), else now: the file is new.
            taken = decoded.capture_times[position] or clock_now()
            files.append(_NewFile(Entry(relative.as_posix(), label, digest, taken), target, new.data))
        return _Prepared(files, embedded.vectors, decoded.signatures or [])

    def remove(self, item_id: int) -> RemovedItem:
        """Delete an item so that it stays deleted (``engine.duplicates.review.delete_items``): its file and
        byte copies set aside into the gallery's trash, restorable by the duplicate review's undo; the
        index saved. A gallery folder that cannot be written refuses it (503), nothing removed."""
        with self.current.writing() as bundle:
            item = find_item(bundle, item_id)
            require_shared_gallery(bundle.index)  # the folder every replica sets photos aside in
            with _storage(f"item {item_id} was not deleted"):
                deletion = delete_items(bundle.index, [item_id])
        return RemovedItem(item, [*deletion.report.moved, *deletion.report.already], deletion.plan_id)


def _label_folder(
    bundle: LoadedBundle, root: Path, label: str | None, position: int, stored: Sequence[str]
) -> str | None:
    """The label (NFC) once it is a safe folder name of its own under ``root``; else InvalidItemError.

    A label that a stored one matches as label filters match (``CAT`` and ``cat``) is that stored label:
    one label is one folder, whatever the case it is sent in."""
    if label is None:
        return None
    try:
        label = check_label(label)
    except InvalidLabelError as err:
        raise InvalidItemError(f"image {position}: {err}") from None
    label = next((known for known in stored if label_key(known) == label_key(label)), label)
    folder = root / label
    if not is_writable_folder(folder):  # a link could lead anywhere; a file (LICENSES.md) holds no images
        raise InvalidItemError(f"image {position}: label {label!r} names a file in the gallery folder")
    if bundle.index.directory.resolve().is_relative_to(folder.resolve()):
        raise InvalidItemError(f"image {position}: label {label!r} names the index's own folder")
    return label


def _gallery_root(bundle: LoadedBundle) -> Path:
    root = bundle.index.manifest.gallery_root
    if root is None:
        raise InvalidItemError("the index records no gallery folder to store new images in")
    return Path(root).resolve()
