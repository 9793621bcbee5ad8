"""Reading the served items: metadata, pages of them, their gallery files and thumbnails."""

from __future__ import annotations

from pathlib import Path

from engine.images import thumbnail_jpeg
from engine.serving import CurrentBundle, LoadedBundle
from index.protocol import Item


class ItemNotFoundError(LookupError):
    """No indexed item has this id."""


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
    root_path = Path(root).resolve()
    path = (root_path / item.path).resolve()
    # resolve() follows symlinks and "..", so a path or link pointing outside the gallery is refused.
    if not path.is_relative_to(root_path) or not path.is_file():
        raise ItemNotFoundError(f"the image of item {item_id} is not available in the gallery")
    return path


class ItemReader:
    def __init__(self, current: CurrentBundle, *, max_pixels: int) -> None:
        self.current = current
        self.max_pixels = max_pixels

    def item(self, item_id: int) -> Item:
        with self.current.reading() as bundle:  # not while a write is half done on the shared connection
            return find_item(bundle, item_id)

    def image_path(self, item_id: int) -> Path:
        """The gallery file of an item, refusing anything that resolves outside the gallery root."""
        with self.current.reading() as bundle:
            return image_path(bundle, item_id)

    def thumbnail(self, item_id: int, size: int) -> bytes:
        """A JPEG of the item's image, at most ``size`` pixels on its longer side."""
        return thumbnail_jpeg(self.image_path(item_id).read_bytes(), size, max_pixels=self.max_pixels)

    def label_counts(self) -> dict[str, int]:
        """Every label with its number of items, by label."""
        with self.current.reading() as bundle:
            return bundle.index.items.label_counts()

    def page(self, offset: int, limit: int) -> tuple[list[Item], int]:
        """A page of items in id order, and the total count."""
        with self.current.reading() as bundle:
            return bundle.index.items.page(offset, limit), len(bundle.index)
