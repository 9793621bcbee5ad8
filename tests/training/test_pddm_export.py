"""Exporting the PDDM unit beside the model: ONNX parity with torch, the card entry, the export command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from engine.model.model_card import ModelCard
from engine.model.reranker import PDDMReranker
from tests.support.train_config import tiny_train_config
from training.export import export_pddm_unit, pddm_path_for
from training.losses.pddm import PDDMUnit
from training.model import build_objective
from training.run_dir import RunDirectory
from training.trainer import train

runner = CliRunner()


def _torch_scores(unit: PDDMUnit, query: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return unit.eval().score(torch.from_numpy(query[None]), torch.from_numpy(candidates[None]))[0].numpy()


@pytest.fixture(scope="module")
def pddm_run(labelled_folder: Path, feature_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step frozen run with the pddm loss (4 classes x 4 samples: the labelled folder's train split).

    Two steps may not beat the untrained model on validation (best = step 0): the best checkpoint's unit
    is then given other weights, so that exporting a fresh unit instead of the checkpoint's would show.
    """
    out = tmp_path_factory.mktemp("pddm") / "run"
    config = tiny_train_config(
        labelled_folder,
        feature_cache,
        loss="pddm",
        loss_hparams={"hidden": 8},
        max_steps=2,
        eval_every=2,
        classes_per_batch=4,
        samples_per_class=4,
    )
    train(config, out, progress=False)
    run = RunDirectory(out)
    best = run.require_best()
    generator = torch.Generator().manual_seed(1)
    unit_keys = [key for key in best.objective if key.startswith("loss.unit.")]
    assert len(unit_keys) == 8  # four linear layers
    for key in unit_keys:
        best.objective[key] = 0.5 * torch.randn(best.objective[key].shape, generator=generator)
    run.save_best(best)
    return out


@pytest.mark.parametrize(("queries", "candidates"), [(1, 1), (1, 37), (3, 50)])
def test_exported_unit_scores_like_torch(tmp_path: Path, queries: int, candidates: int) -> None:
    torch.manual_seed(3)
    unit = PDDMUnit(dim=16, hidden=8)
    for parameter in unit.parameters():  # away from the initialisation: a fixed, non-trivial unit
        torch.nn.init.normal_(parameter, std=0.5)
    card = export_pddm_unit(unit, tmp_path / "model.pddm.onnx")
    assert card.kind == "pddm" and card.file == "model.pddm.onnx"
    reranker = PDDMReranker(tmp_path / card.file, threads=1)
    rng = np.random.default_rng(queries * candidates)
    # Unnormalised inputs: the unit puts them on the sphere itself, in torch and in the graph alike.
    query_batch = rng.normal(size=(queries, 16)).astype(np.float32) * 3
    candidate_batch = rng.normal(size=(queries, candidates, 16)).astype(np.float32)
    for query, pool in zip(query_batch, candidate_batch, strict=True):
        expected = _torch_scores(unit, query, pool)
        actual = reranker.score(query, pool)
        assert actual.shape == (candidates,) and actual.dtype == np.float32
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert len(set(np.round(expected, 4))) == candidates  # distinct scores: the parity is not vacuous


def test_export_of_a_pddm_run_writes_the_unit_and_names_it_in_the_card(pddm_run: Path) -> None:
    result = runner.invoke(app, ["export", str(pddm_run), "--force"])  # two steps: maybe not better
    assert result.exit_code == 0, result.output
    model_path = pddm_run / "model.onnx"
    unit_path = pddm_path_for(model_path)
    assert f"wrote {unit_path}" in result.output
    card = ModelCard.load(model_path)
    assert card.loss == "pddm" and card.reranker is not None
    assert card.reranker.file == "model.pddm.onnx" and card.reranker.path_beside(model_path) == unit_path
    reranker = PDDMReranker.for_model(model_path, card, threads=1)
    assert reranker is not None

    # The exported graph is the run's best checkpoint's unit, not a fresh one.
    run = RunDirectory(pddm_run)
    objective = build_objective(run.require_config(), 1280)
    objective.load_state_dict(run.require_best().objective)
    rng = np.random.default_rng(0)
    query, candidates = rng.normal(size=16).astype(np.float32), rng.normal(size=(20, 16)).astype(np.float32)
    np.testing.assert_allclose(
        reranker.score(query, candidates), _torch_scores(objective.loss.unit, query, candidates), atol=1e-5
    )
    fresh = build_objective(run.require_config(), 1280).loss.unit
    assert not np.allclose(reranker.score(query, candidates), _torch_scores(fresh, query, candidates))


def test_a_changed_unit_file_is_refused(pddm_run: Path, tmp_path: Path) -> None:
    model_path = tmp_path / "model.onnx"
    assert runner.invoke(app, ["export", str(pddm_run), "--out", str(model_path), "--force"]).exit_code == 0
    card = ModelCard.load(model_path)
    unit_path = pddm_path_for(model_path)
    unit_path.write_bytes(unit_path.read_bytes() + b"\0")
    with pytest.raises(ValueError, match=r"does not match its model\.json"):
        PDDMReranker.for_model(model_path, card)
    unit_path.unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.pddm\.onnx"):
        PDDMReranker.for_model(model_path, card)
