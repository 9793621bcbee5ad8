"""engine.serve.item_reader: gallery files are untrusted input (issue 43, classes 3 and 4): thumbnails are
decoded in a decode process that reads the file itself, once per size bucket of each content."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from bench.lib.images import image_bytes, make_image
from engine.model.embedder import Embedder
from engine.serve.item_reader import THUMBNAIL_BUCKETS, ItemReader
from engine.serve.item_writer import ItemWriter, NewItem
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from foundation.defaults import MAX_IMAGE_PIXELS
from index.gallery import GalleryIndex
from index.selection import IndexOptions
from tests.support.decoding import CountingDecoder


@pytest.fixture
def served(small_model: Path, tmp_path: Path) -> Iterator[tuple[CurrentBundle, int, Path]]:
    """A served index of one 900x700 item: its bundle, id and gallery file."""
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    embedder = Embedder(small_model, threads=1)
    GalleryIndex.create(
        tmp_path / "index",
        dim=embedder.dim,
        model_fingerprint=embedder.fingerprint,
        gallery_root=gallery,
        options=IndexOptions("flat"),
    ).close()
    current = CurrentBundle(LoadedBundle(embedder, GalleryIndex.open(tmp_path / "index")))
    (item,) = ItemWriter(current, ServingConfig()).add([NewItem(image_bytes(make_image(5, size=(900, 700))))])
    yield current, item.id, gallery / item.path
    current.bundle.index.close()


def test_every_thumbnail_size_costs_at_most_one_decode_per_bucket(served) -> None:
    """Before: each of the 1,009 sizes the API takes decoded the gallery file again (2.5 s of CPU each for a
    costly one), and a repeat of a size already made decoded nothing only for that exact size. Asked: every
    fourth size of the API's 16 ... 1024 and each side of every bucket's edge and of the image's own size
    (each shrinks and encodes a JPEG: asking all 1,009 was most of this test's CPU time)."""
    current, item_id, _ = served
    decoder = CountingDecoder()
    reader = ItemReader(current, max_pixels=MAX_IMAGE_PIXELS, decoder=decoder)
    edges = {edge + step for edge in (*THUMBNAIL_BUCKETS, 900) for step in (-1, 0, 1)}
    for size in sorted({*range(16, 1025, 4), *(edges & set(range(16, 1025)))}):
        thumbnail = Image.open(io.BytesIO(reader.thumbnail(item_id, size)))
        assert max(thumbnail.size) == min(size, 900), size
    for size in (16, 100, 256, 1000):  # asked again: made already
        reader.thumbnail(item_id, size)
    assert len(decoder.calls) == len(THUMBNAIL_BUCKETS)


def test_the_decode_process_is_given_the_path_never_the_file(served) -> None:
    """Before: the server read the whole file (a 147 MB TIFF: 561 MB more for 2 concurrent thumbnails)
    and sent its bytes to the decode process."""
    current, item_id, path = served
    decoder = CountingDecoder()
    ItemReader(current, max_pixels=MAX_IMAGE_PIXELS, decoder=decoder).thumbnail(item_id, 200)
    ((given, size),) = decoder.calls
    assert given == path.resolve() and size == 256
