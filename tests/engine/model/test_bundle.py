"""An index carries its model: build-index stores it, query needs no --model, a copied index still works,
a --model that is not the index's is refused, and indexes built before keep working with --model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.lib.images import export_small_model, make_image
from cli.main import app
from engine.model.bundle import STORED_MODEL, locate_model, store_model
from engine.model.model_card import ModelCard, file_fingerprint
from engine.model.reranker import PDDMReranker
from engine.serve.search import SearchService
from index.gallery import IndexMismatchError
from index.manifest import Manifest

runner = CliRunner()


def _invoke(*args: object) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _top(index: Path, image: Path, *model: object) -> list[tuple[str, float]]:
    code, output = _invoke("query", image, "--index", index, *model, "-k", "3", "--json")
    assert code == 0, output
    return [(r["path"], round(r["score"], 5)) for r in json.loads(output)["results"]]


def _model_copy(model: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(model, folder / model.name)
    shutil.copy(ModelCard.path_for(model), folder / ModelCard.path_for(model).name)
    return folder / model.name


@pytest.fixture
def bundle(small_model: Path, synthetic_gallery: Path, tmp_path: Path) -> tuple[Path, Path]:
    """An index built with a model that is then deleted: (index, the deleted model's path)."""
    model = _model_copy(small_model, tmp_path / "models")
    out = tmp_path / "index"
    code, output = _invoke("build-index", synthetic_gallery, "--model", model, "--out", out, "--no-progress")
    assert code == 0, output
    return out, model


def test_build_index_stores_its_model_hard_linked(bundle: tuple[Path, Path]) -> None:
    index, model = bundle
    manifest = Manifest.load(index)
    assert manifest.model_file == STORED_MODEL
    stored = index / STORED_MODEL
    assert os.path.samefile(stored, model)  # a hard link on one file system: no bytes copied
    assert ModelCard.path_for(stored).read_bytes() == ModelCard.path_for(model).read_bytes()
    assert file_fingerprint(stored) == manifest.model_fingerprint == ModelCard.load(stored).fingerprint
    assert locate_model(index).path == stored
    assert locate_model(index).card == ModelCard.load(stored)


def test_query_needs_no_model_and_a_copied_index_still_answers(
    bundle: tuple[Path, Path], synthetic_gallery: Path, tmp_path: Path
) -> None:
    index, model = bundle
    image = synthetic_gallery / "beta" / "beta_2.png"
    expected = _top(index, image, "--model", model)
    assert expected[0] == ("beta/beta_2.png", 1.0)
    assert _top(index, image) == expected
    # Elsewhere, with the original model and index gone: the copy is a search engine on its own.
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(index, moved)
    shutil.rmtree(model.parent)
    shutil.rmtree(index)
    assert _top(moved, image) == expected


def test_build_index_again_updates_with_the_model_the_index_carries(
    bundle: tuple[Path, Path], synthetic_gallery: Path
) -> None:
    index, model = bundle
    shutil.rmtree(model.parent)  # the model it was built with is gone from where it was exported
    make_image(77).save(synthetic_gallery / "alpha" / "alpha_new.png")
    code, output = _invoke("build-index", synthetic_gallery, "--out", index, "--no-progress")
    assert code == 0, output
    assert "indexed 1 images" in output and "9 unchanged" in output
    assert Manifest.load(index).count == 10


def test_a_model_that_is_not_the_index_s_is_refused(
    bundle: tuple[Path, Path], exported_model: Path, synthetic_gallery: Path
) -> None:
    index, _ = bundle
    image = synthetic_gallery / "alpha" / "alpha_0.png"
    code, output = _invoke("query", image, "--index", index, "--model", exported_model)
    assert code == 2
    assert f"is not the model {index.resolve()} was built with" in output.replace("\n", "")
    assert "leave the model path out to use the one it carries" in output.replace("\n", "")
    assert "Traceback" not in output
    with pytest.raises(IndexMismatchError):
        SearchService.open(exported_model, index, threads=1)


def test_an_index_built_before_needs_and_accepts_its_model(
    bundle: tuple[Path, Path], small_model: Path, synthetic_gallery: Path
) -> None:
    index, _ = bundle
    manifest = Manifest.load(index)
    manifest.model_file = None  # what indexes written before model storage look like
    manifest.save(index)
    for name in (STORED_MODEL, "model.json"):
        (index / name).unlink()
    image = synthetic_gallery / "gamma" / "gamma_0.png"
    code, output = _invoke("query", image, "--index", index)
    assert code == 2 and "carries no model" in output.replace("\n", "")
    assert _top(index, image, "--model", small_model)[0] == ("gamma/gamma_0.png", 1.0)


def test_a_bundle_missing_its_model_files_says_so(bundle: tuple[Path, Path], synthetic_gallery: Path) -> None:
    index, _ = bundle
    (index / STORED_MODEL).unlink()
    code, output = _invoke("query", synthetic_gallery / "alpha" / "alpha_1.png", "--index", index)
    assert code == 2 and "copy the whole index directory" in output.replace("\n", "")


def test_the_pddm_unit_travels_with_the_model(small_model: Path, tmp_path: Path) -> None:
    from training.export import export_pddm_unit
    from training.losses.pddm import PDDMUnit

    source = tmp_path / "run" / "pddm.onnx"
    source.parent.mkdir()
    unit = export_pddm_unit(PDDMUnit(dim=24, hidden=8), source.with_name("pddm.pddm.onnx"))
    export_small_model(source, seed=7, reranker=unit)
    index = tmp_path / "index"
    index.mkdir()
    assert store_model(index, source) == STORED_MODEL
    assert (index / "pddm.pddm.onnx").read_bytes() == source.with_name("pddm.pddm.onnx").read_bytes()
    card = ModelCard.load(index / STORED_MODEL)
    assert card.reranker is not None and card.reranker.path_beside(index / STORED_MODEL).is_file()
    shutil.rmtree(source.parent)
    assert PDDMReranker.for_model(index / STORED_MODEL, card, threads=1) is not None
