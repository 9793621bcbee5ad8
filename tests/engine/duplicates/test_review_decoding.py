"""The duplicate review reads gallery pixels as untrusted input (issue 43, class 3): through the server's
decoder, which is given each file's path, never decoding in the server process."""

from __future__ import annotations

from pathlib import Path

from PIL import PngImagePlugin

from bench.lib.images import make_image
from engine.build.indexing import build_index
from engine.duplicates.finder import DuplicateFinder
from engine.duplicates.tiers import Tier
from engine.model.embedder import Embedder
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle
from tests.support.decoding import CountingDecoder


def test_pixel_digests_of_the_review_go_through_the_servers_decoder(
    small_model: Path, tmp_path: Path
) -> None:
    """Before: the exact tier's pixel digests decoded every file with identical signatures in full, in the
    server process, without any limit but the pixel count (a 49-MP WebP: 750 MB there)."""
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    photo = make_image(11, size=(120, 90))
    photo.save(gallery / "a.png")
    note = PngImagePlugin.PngInfo()
    note.add_text("note", "same pixels, other bytes")
    photo.save(gallery / "b.png", pnginfo=note)
    make_image(12, size=(120, 90)).save(gallery / "c.png")
    build_index(gallery, Embedder(small_model, threads=1), tmp_path / "index", progress=False)
    decoder = CountingDecoder()
    finder = DuplicateFinder(CurrentBundle(LoadedBundle.open(small_model, tmp_path / "index")), decoder)
    page = finder.tiered_page(Tier.EXACT, 0, 10)
    assert [{member.item.path for member in group.members} for group in page.groups] == [{"a.png", "b.png"}]
    assert sorted(args for args in decoder.calls) == [(gallery / "a.png",), (gallery / "b.png",)]
