"""The feature cache is keyed by content: the same images elsewhere reuse it, a changed image does not."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from engine.decode.images import load_image_file
from foundation import stopping
from tests.support.images import copy_with_truncated_jpeg
from training import features
from training.data import load_labelled_images
from training.features import FeatureExtractor


@pytest.fixture
def private_cache(feature_cache: Path, tmp_path: Path) -> Path:
    """A cache of its own (so its cached entries can be counted), with the session's exported backbone."""
    cache = tmp_path / "cache"
    shutil.copytree(feature_cache / "backbones", cache / "backbones")
    return cache


def _entries(cache: Path) -> set[str]:
    return {path.name for path in (cache / "features").iterdir()}


def test_copied_images_reuse_the_cache_and_a_changed_image_does_not(
    labelled_folder: Path, private_cache: Path, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    copy_with_truncated_jpeg(labelled_folder, first)
    extractor = FeatureExtractor(private_cache, progress=False)
    with pytest.warns(UserWarning, match="skipped unreadable image"):
        original = extractor.extract(load_labelled_images(first).files(), view=1, seed=3)
    cached = _entries(private_cache)

    # A copy elsewhere: new paths and new modification times (shutil.copy does not keep them), same bytes.
    second = tmp_path / "second"
    shutil.copytree(first, second, copy_function=shutil.copy)
    files = load_labelled_images(second).files()
    with pytest.warns(UserWarning, match=f"skipped unreadable image {second}/class_01/broken.jpg"):
        copied = extractor.extract(files, view=1, seed=3)
    assert _entries(private_cache) == cached  # nothing extracted again
    np.testing.assert_array_equal(copied.features, original.features)
    assert [path for path, _ in copied.skipped] == [str(second / "class_01" / "broken.jpg")]

    changed = files.index(second / "class_02" / "img_1.png")
    load_image_file(files[changed]).rotate(90).save(files[changed])
    with pytest.warns(UserWarning, match="skipped unreadable image"):
        after = extractor.extract(files, view=1, seed=3)
    assert len(_entries(private_cache) - cached) == 1  # re-extracted under a new key
    assert not np.allclose(after.features[changed], original.features[changed], atol=1e-3)
    unchanged = np.arange(len(files)) != changed
    np.testing.assert_allclose(after.features[unchanged], original.features[unchanged], atol=1e-6)


def test_a_stop_signal_ends_extraction_after_a_shard_and_a_rerun_resumes(
    labelled_folder: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(features, "SHARD_SIZE", 8)  # 60 images: 8 shards
    files = load_labelled_images(labelled_folder).files()
    extractor = FeatureExtractor(private_cache, progress=False)
    with stopping.stop_on_signals(), pytest.raises(stopping.StopRequested):
        signal.raise_signal(signal.SIGTERM)  # as `kill -TERM` during a long extraction
        extractor.extract(files)
    (entry,) = (private_cache / "features").iterdir()
    assert [shard.name for shard in entry.iterdir()] == ["shard-00000.npz"]  # the shard in progress, no more
    resumed = extractor.extract(files)
    assert len(list(entry.iterdir())) == 8
    shutil.copytree(private_cache / "backbones", private_cache.parent / "other" / "backbones")
    whole = FeatureExtractor(private_cache.parent / "other", progress=False)  # in one go, elsewhere
    np.testing.assert_allclose(resumed.features, whole.extract(files).features, atol=1e-6)
