"""The gallery folder's files and its symlink rule (engine/gallery/files.py); listing through links is
also covered end to end in tests/engine/build/test_indexing.py and tests/training/test_data.py."""

from __future__ import annotations

from pathlib import Path

from bench.lib.images import make_image
from engine.gallery.files import is_writable_folder, list_images, own_folders, resolves_inside
from foundation.defaults import TRASH_FOLDER


def _gallery(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "gallery", tmp_path / "outside"
    for folder in (root / "cats", outside):
        folder.mkdir(parents=True)
    make_image(1).save(root / "cats" / "a.png")
    make_image(2).save(outside / "b.png")
    return root, outside


def test_a_path_is_inside_only_where_it_resolves(tmp_path: Path) -> None:
    root, outside = _gallery(tmp_path)
    (root / "link.png").symlink_to(outside / "b.png")
    (root / "inner.png").symlink_to(root / "cats" / "a.png")
    assert resolves_inside(root / "cats" / "a.png", root)
    assert resolves_inside(root / "inner.png", root)
    assert not resolves_inside(root / "link.png", root)
    assert not resolves_inside(root / "cats" / ".." / ".." / "outside" / "b.png", root)
    linked_root = tmp_path / "linked-gallery"  # the gallery reached through a link of its own
    linked_root.symlink_to(root)
    assert resolves_inside(linked_root / "cats" / "a.png", root)
    assert resolves_inside(root / "cats" / "a.png", linked_root)


def test_new_files_go_into_real_folders_only(tmp_path: Path) -> None:
    root, outside = _gallery(tmp_path)
    (root / "dogs").symlink_to(outside, target_is_directory=True)
    (root / "LICENSES.md").write_text("not a folder")
    assert is_writable_folder(root / "cats") and is_writable_folder(root / "birds")  # birds: made on write
    assert not is_writable_folder(root / "dogs") and not is_writable_folder(root / "LICENSES.md")
    assert own_folders(root) == [root / "cats"]


def test_listing_follows_links_out_but_not_aliases_loops_or_the_trash(tmp_path: Path) -> None:
    root, outside = _gallery(tmp_path)
    (root / "dogs").symlink_to(outside, target_is_directory=True)  # leads outside: followed
    (root / "alias").symlink_to(root / "cats", target_is_directory=True)  # inside: listed at its own path
    (root / "cats" / "loop").symlink_to(root, target_is_directory=True)  # back above itself
    (root / TRASH_FOLDER).mkdir()
    make_image(3).save(root / TRASH_FOLDER / "gone.png")
    (root / "cats" / "notes.txt").write_text("not an image")
    assert list_images(root) == [root / "cats" / "a.png", root / "dogs" / "b.png"]
