"""Labelled image collections (folder or CSV) and the DML class split."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from training.data import DataError, load_labelled_images, split_classes


def _write_csv(path: Path, rows: list[str], header: str = "path,label,split") -> Path:
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


def test_folder_labels_are_the_class_folders(labelled_folder: Path) -> None:
    data = load_labelled_images(labelled_folder)
    assert len(data) == 60 and len(data.class_names) == 12
    assert data.class_names[3] == "class_03"
    assert all(data.paths[i].startswith(data.class_names[label] + "/") for i, label in enumerate(data.labels))
    assert data.splits is None


def test_class_folders_may_be_links(labelled_folder: Path, tmp_path: Path) -> None:
    """A training set assembled from folders elsewhere, each class folder a link; a link back up ends."""
    elsewhere, linked = tmp_path / "elsewhere", tmp_path / "linked"
    shutil.copytree(labelled_folder, elsewhere)
    linked.mkdir()
    for folder in sorted(elsewhere.iterdir()):
        (linked / folder.name).symlink_to(folder, target_is_directory=True)
    (elsewhere / "class_00" / "loop").symlink_to(linked, target_is_directory=True)
    data = load_labelled_images(linked)
    assert len(data) == 60 and data.class_names == load_labelled_images(labelled_folder).class_names
    (tmp_path / "via_link").symlink_to(linked, target_is_directory=True)  # the folder given is a link
    assert len(load_labelled_images(tmp_path / "via_link")) == 60


def test_dml_split_trains_on_the_first_half_and_validates_on_held_out_training_classes(
    labelled_folder: Path,
) -> None:
    data = load_labelled_images(labelled_folder)
    split = split_classes(data)
    train, val, test = (set(data.labels[split[name]].tolist()) for name in ("train", "val", "test"))
    assert test == set(range(6, 12))
    assert train == set(range(4)) and val == {4, 5}  # the last 20% of 6 classes, at least two
    assert len(split.train) + len(split.val) + len(split.test) == len(data)
    assert len(split_classes(data, val_fraction=0.5).val) == 3 * 5
    override = split_classes(data, train_classes=9)
    assert set(data.labels[override.test].tolist()) == {9, 10, 11}
    with pytest.raises(DataError, match="between 1 and 11"):
        split_classes(data, train_classes=12)
    with pytest.raises(DataError, match="too few"):
        split_classes(data, train_classes=3)


def test_class_folds_cross_validate_within_the_training_classes(labelled_folder: Path) -> None:
    data = load_labelled_images(labelled_folder)
    plain = split_classes(data, train_classes=9)  # classes 0-8 train (+ val), 9-11 never used by folds
    tests = []
    for fold in range(3):
        split = split_classes(data, train_classes=9, fold=fold, folds=3)
        train, val, test = (set(data.labels[split[name]].tolist()) for name in ("train", "val", "test"))
        assert test == set(range(3 * fold, 3 * fold + 3))  # the fold-th contiguous block
        assert not (train | val) & test and (train | val | test) == set(range(9))
        assert val == set(sorted(train | val)[-2:])  # checkpoint selection on the last training classes
        assert list(split.pool) == list(plain.pool)  # one augmented-view cache serves every fold
        tests.append(test)
    assert set().union(*tests) == set(range(9))
    with pytest.raises(DataError, match="fold must be"):
        split_classes(data, fold=3, folds=3)


def test_csv_with_split_column(labelled_folder: Path, tmp_path: Path) -> None:
    rows = []
    for label in range(6):
        split = "train" if label < 3 else ("val" if label < 4 else "test")
        rows += [
            f"{labelled_folder.name}/class_{label:02d}/img_{i}.png,car {label},{split}" for i in range(5)
        ]
    table = _write_csv(labelled_folder.parent / "listing.csv", rows)
    data = load_labelled_images(table)
    assert data.class_names[0] == "car 0" and len(data) == 30
    split = split_classes(data)
    assert set(data.labels[split.val].tolist()) == {3}  # the CSV's val rows, nothing carved
    assert set(data.labels[split.test].tolist()) == {4, 5}
    assert (data.root / data.paths[0]).is_file()


@pytest.mark.parametrize(
    ("header", "rows", "message"),
    [
        ("path,class", ["a.png,x"], "needs the columns path,label"),
        ("path,label,split", ["images/class_00/img_0.png,x,holdout"], "unknown split"),
        ("path,label", ["nope.png,x"], "do not exist"),
    ],
)
def test_bad_csv_is_a_clear_error(labelled_folder: Path, header: str, rows: list[str], message: str) -> None:
    table = _write_csv(labelled_folder.parent / f"bad_{abs(hash(message))}.csv", rows, header)
    with pytest.raises(DataError, match=message):
        load_labelled_images(table)


def test_a_class_in_two_splits_is_refused(labelled_folder: Path) -> None:
    rows = [f"images/class_00/img_{i}.png,a,{'train' if i < 3 else 'test'}" for i in range(5)]
    table = _write_csv(labelled_folder.parent / "overlap.csv", rows)
    with pytest.raises(DataError, match="both the train and the test split"):
        split_classes(load_labelled_images(table))


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"neither an image folder nor a \.csv"):
        load_labelled_images(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no labelled images"):
        load_labelled_images(tmp_path / "empty")
