"""Reading the served items: metadata, pages of them, their gallery files and thumbnails."""

from __future__ import annotations

import threading
from pathlib import Path

from cachetools import LRUCache

from engine.decode.images import ImageDecodeError, thumbnail_jpeg
from engine.decode.pool import Decoder, GalleryMemoryError, InProcessDecoder, gallery_memory_is_the_servers
from engine.gallery.files import resolves_inside
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle
from foundation.errors import DmlsearchError, ErrorKind
from index.protocol import Item


class ItemNotFoundError(DmlsearchError, LookupError):
    """No indexed item has this id."""

    kind = ErrorKind.NOT_FOUND
    code = "item_not_found"


def find_item(bundle: LoadedBundle, item_id: int) -> Item:
    """The item, or ``ItemNotFoundError``; call it under the bundle's lock."""
    item = bundle.index.items.get(item_id)
    if item is None:
        raise ItemNotFoundError(f"no item with id {item_id}")
    return item


def image_path(bundle: LoadedBundle, item_id: int) -> Path:
    """The gallery file of an item, refusing anything that resolves outside the gallery root; call it
    under the bundle's lock."""
    item = find_item(bundle, item_id)
    root = bundle.index.manifest.gallery_root
    if root is None:
        raise ItemNotFoundError(f"item {item_id} has no stored image (the index records no gallery)")
    path = Path(root, item.path)
    if not resolves_inside(path, Path(root)) or not path.is_file():
        raise ItemNotFoundError(f"the image of item {item_id} is not available in the gallery")
    return path.resolve()


# Thumbnails kept, by (content hash, size): each is made once. ~8 KB each at 256 px: ~4,000 of them.
THUMBNAIL_CACHE_BYTES = 32 * 1024**2
# The sizes a gallery file is decoded to: any other size is shrunk from the next one up, a JPEG of our own
# making, so the 1,009 sizes the API takes (16-1024) cost at most 5 decodes of an item, not one each (an
# item that took 2.5 s of CPU to decode took them again for each new size).
THUMBNAIL_BUCKETS = (64, 128, 256, 512, 1024)
# Items whose image is over a decode limit, remembered (by content hash) so that no size decodes it again.
COSTLY_ITEMS_KEPT = 10_000


class ItemReader:
    def __init__(self, current: CurrentBundle, *, max_pixels: int, decoder: Decoder | None = None) -> None:
        self.current = current
        self.max_pixels = max_pixels
        self.decoder = decoder or InProcessDecoder()
        self._thumbnails: LRUCache[tuple[str, int], bytes] = LRUCache(THUMBNAIL_CACHE_BYTES, getsizeof=len)
        self._costly: LRUCache[str, ImageDecodeError | GalleryMemoryError] = LRUCache(COSTLY_ITEMS_KEPT)
        self._cache_lock = threading.Lock()  # cachetools' caches are not thread-safe

    def item(self, item_id: int) -> Item:
        with self.current.reading() as bundle:  # not while a write is half done on the shared connection
            return find_item(bundle, item_id)

    def image_path(self, item_id: int) -> Path:
        """The gallery file of an item, refusing anything that resolves outside the gallery root."""
        with self.current.reading() as bundle:
            return image_path(bundle, item_id)

    def thumbnail(self, item_id: int, size: int) -> bytes:
        """A JPEG of the item's image, at most ``size`` pixels on its longer side: the gallery file is
        decoded in a decode process once per size bucket (it reads the file: this process never holds
        it), other sizes are shrunk from the bucket's JPEG; an image over a decode limit is refused at
        once after its first try."""
        content = self.item(item_id).content_hash
        bucket = next((bucket for bucket in THUMBNAIL_BUCKETS if bucket >= size), size)
        with self._cache_lock:
            if (refused := self._costly.get(content)) is not None:
                raise refused
            kept, base = self._thumbnails.get((content, size)), self._thumbnails.get((content, bucket))
        if kept is not None:
            return kept
        if base is None:
            path = self.image_path(item_id)
            try:
                with gallery_memory_is_the_servers([path]):
                    base = self.decoder.run(thumbnail_jpeg, path, bucket, max_pixels=self.max_pixels)
            except (ImageDecodeError, GalleryMemoryError) as err:  # it would fail again: refused at once
                if isinstance(err, GalleryMemoryError) or err.code == "image_too_costly":
                    with self._cache_lock:
                        self._costly[content] = err
                raise
        # Our own JPEG of at most 1024 px, not the gallery's file: shrunk here in milliseconds.
        thumbnail = base if size == bucket else thumbnail_jpeg(base, size)
        with self._cache_lock:
            self._thumbnails[(content, bucket)] = base
            self._thumbnails[(content, size)] = thumbnail
        return thumbnail

    def label_counts(self) -> dict[str, int]:
        """Every label with its number of items, by label."""
        with self.current.reading() as bundle:
            return bundle.index.items.label_counts()

    def page(self, offset: int, limit: int) -> tuple[list[Item], int]:
        """A page of items in id order, and the total count."""
        with self.current.reading() as bundle:
            return bundle.index.items.page(offset, limit), len(bundle.index)
