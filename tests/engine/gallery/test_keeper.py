"""The keeper rule's folder key (engine.gallery.keeper.GroupVectors.home_folder) on a real FAISS index whose
vectors are placed by hand: which folder a group of copies belongs to; and the order of its date keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.gallery.keeper import FileFacts, GroupVectors, choose_keeper
from foundation.defaults import SIMILAR_COSINE
from index.gallery import GalleryIndex
from index.protocol import Entry

DIM = 32


def _at_cosine(rng: np.random.Generator, photo: np.ndarray, cosine: float) -> np.ndarray:
    """A unit vector at exactly ``cosine`` to the unit vector ``photo``."""
    away = rng.standard_normal(DIM)
    away -= (away @ photo) * photo
    away /= np.linalg.norm(away)
    return cosine * photo + np.sqrt(1 - cosine**2) * away


def _index(tmp_path: Path, folders: dict[str, list[float]]) -> tuple[GalleryIndex, dict[str, int]]:
    """One photo in ``class`` (its folder is listed first) and, per folder, images at the given cosines to
    it; returns the index and each path's id."""
    rng = np.random.default_rng(0)
    photo = rng.standard_normal(DIM)
    photo /= np.linalg.norm(photo)
    paths, vectors = ["class/photo.jpg"], [photo]
    for folder, cosines in folders.items():
        for number, cosine in enumerate(cosines):
            paths.append(f"{folder}/{number}.jpg")
            vectors.append(_at_cosine(rng, photo, cosine))
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    entries = [Entry(path, path.split("/")[0], f"hash-{path}") for path in paths]
    ids = index.add(np.stack(vectors).astype(np.float32), entries)
    return index, dict(zip(paths, ids, strict=True))


def test_a_folder_of_edits_of_the_photo_is_not_its_label_folder(tmp_path: Path) -> None:
    """``cp -p class/photo.jpg "edited/photo copy.jpg"`` beside a resize, a re-encode and a crop of the photo
    in ``edited/`` (cosines 0.93-0.99) and two other edits there, while ``class/`` holds other photos of
    the same thing (0.72-0.85). The edits looked most like the photo, so the copy's folder won; they are
    copies of it, not evidence of what ``edited/`` holds."""
    index, ids = _index(
        tmp_path, {"class": [0.85, 0.80, 0.76, 0.72, 0.6], "edited": [0.99, 0.97, 0.93, 0.55, 0.5]}
    )
    assert max([0.99, 0.97, 0.93]) >= SIMILAR_COSINE > max(0.85, 0.55)
    home = GroupVectors(index).home_folder([ids["class/photo.jpg"]], ["edited", "class"])
    assert home == "class"


def test_a_folder_of_one_photo_and_its_takes_is_its_label_folder(tmp_path: Path) -> None:
    """The demo gallery's kind of class folder: the photo and its variants only (all at the similar tier's
    cosine or above), against ``edited/`` holding the byte copy and an edit of another photo. With nothing
    else in ``class/``, its copies are what it holds."""
    index, ids = _index(tmp_path, {"class": [0.98, 0.96, 0.94, 0.92], "edited": [0.2]})
    home = GroupVectors(index).home_folder([ids["class/photo.jpg"]], ["edited", "class"])
    assert home == "class"


def _facts(label: str, date: str, dated_by: str) -> FileFacts:
    return FileFacts(640, 480, 1000, None, date, dated_by, label)


def test_a_file_time_comes_after_the_label_folder_and_a_capture_time_before_it() -> None:
    """An edited copy elsewhere whose file time is older (`touch -d 2020-01-01`) does not beat the photo in
    its label folder; a camera's capture time does; and between files nothing else tells apart, the older
    file time wins."""
    photo = _facts("hummer", "2026-11-29T10:00:00+00:00", "file time")
    touched = _facts("edited", "2020-01-01T00:00:00+00:00", "file time")
    choice = choose_keeper([touched, photo], "hummer")
    assert choice.keeper == 1 and "in its label folder 'hummer'" in choice.reason
    captured = _facts("edited", "2019-06-01T10:00:00", "camera clock")
    choice = choose_keeper([photo, captured], "hummer")
    assert choice.keeper == 1 and "earliest capture time (2019-06-01T10:00:00, camera clock)" in choice.reason
    choice = choose_keeper([photo, touched], None)  # no label folder tells them apart
    assert choice.keeper == 1 and "the earliest file time (2020-01-01T00:00:00+00:00" in choice.reason
