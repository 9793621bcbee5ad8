"""The explainable export: the feature map as a second output, the explainer graph beside the model, and
the split of the served cosine over image positions (exact: the shares sum to the cosine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from engine.decode.images import load_image_file
from engine.gallery.files import list_images
from engine.model.embedder import Embedder
from engine.model.explainer import Explainer
from engine.model.model_card import EMBEDDINGS_OUTPUT, MAPS_OUTPUT, ModelCard
from training.backbone import BACKBONES, create_backbone
from training.export import export_onnx
from training.heads import ResidualHead
from training.model import EmbeddingModel, PositionContributions, explainable


def _head_with_biases(seed: int = 0) -> ResidualHead:
    """A residual head whose every part matters: a live MLP (some ReLU gates open, some shut) and
    non-zero biases, so the split has a non-zero rest."""
    torch.manual_seed(seed)
    head = ResidualHead(1280, 32, 64)
    torch.nn.init.normal_(head.residual[2].weight, std=0.05)
    for bias in (head.residual[0].bias, head.residual[2].bias, head.projection.bias):
        torch.nn.init.normal_(bias, std=0.005)  # the size of the projection's outputs: not all of them
    return head.eval()


@pytest.fixture(scope="module")
def head_model() -> EmbeddingModel:
    return EmbeddingModel(create_backbone(), _head_with_biases()).eval()


@pytest.fixture(scope="module")
def head_export(head_model: EmbeddingModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("head_model") / "model.onnx"
    export_onnx(
        head_model,
        path,
        preprocessing=BACKBONES["efficientnet_lite0"].preprocessing,
        backbone="efficientnet_lite0",
        head="residual-mlp(1280->64->32)+pca-linear",
    )
    return path


def _batch(embedder: Embedder, gallery: Path, count: int = 6) -> np.ndarray:
    return embedder.preprocess([load_image_file(path) for path in list_images(gallery)[:count]])


def test_the_export_has_the_feature_map_and_its_explainer(exported_model: Path) -> None:
    card = ModelCard.load(exported_model)
    assert card.explainer is not None and card.explainer.grid == (7, 7)
    graph = onnx.load(str(exported_model)).graph
    assert [output.name for output in graph.output] == [EMBEDDINGS_OUTPUT, MAPS_OUTPUT]
    explainer = card.explainer.path_beside(exported_model)
    assert explainer.is_file() and explainer.name == "model.explain.onnx"


def test_embeddings_and_maps_match_torch(
    head_model: EmbeddingModel, head_export: Path, demo_gallery: Path
) -> None:
    embedder = Embedder(head_export, threads=1)
    batch = _batch(embedder, demo_gallery)
    embeddings, maps = embedder.embed_with_maps(batch)
    with torch.no_grad():
        images = torch.from_numpy(batch)
        expected = head_model(images).numpy()
        expected_maps = head_model.backbone.forward_features(images).numpy()
        contributions, rest = PositionContributions(head_model)(torch.from_numpy(maps))
    np.testing.assert_allclose(embeddings, expected, atol=2e-4)
    np.testing.assert_allclose(maps, expected_maps, atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(embedder.embed_tensor(batch), embeddings, atol=1e-6)  # one graph, one answer
    exported = Explainer.for_model(head_export, embedder.card).split(maps)
    np.testing.assert_allclose(exported[0], contributions.numpy(), atol=1e-6)
    np.testing.assert_allclose(exported[1], rest.numpy(), atol=1e-6)


@pytest.mark.parametrize("which", ["pretrained", "head"])
def test_the_position_shares_sum_to_the_served_cosine(
    which: str, exported_model: Path, head_export: Path, demo_gallery: Path
) -> None:
    model = exported_model if which == "pretrained" else head_export
    embedder = Embedder(model, threads=1)
    batch = _batch(embedder, demo_gallery)
    served = embedder.embed_tensor(batch)  # what the index holds and search compares
    _, maps = embedder.embed_with_maps(batch)
    contributions, rest = Explainer.for_model(model, embedder.card).split(maps)
    cosines = served @ served.T
    # Each image's grid against every other image's embedding, plus its rest: the cosine.
    totals = np.einsum("ahwd,bd->ab", contributions, served) + rest @ served.T
    np.testing.assert_allclose(totals, cosines, atol=2e-5)
    assert np.ptp(cosines) > 0.05  # different pairs, not one number
    if which == "head":  # the biases' share is real, and reported apart from the positions
        assert np.abs(rest @ served.T).max() > 0.01
    else:
        assert np.abs(rest).max() == 0.0


def test_a_model_that_does_not_average_a_map_exports_as_before(small_model: Path) -> None:
    assert ModelCard.load(small_model).explainer is None
    assert [output.name for output in onnx.load(str(small_model)).graph.output] == [EMBEDDINGS_OUTPUT]
    network = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten())
    assert not explainable(EmbeddingModel(network))
    assert not explainable(EmbeddingModel(create_backbone(), torch.nn.Linear(1280, 8)))  # an unknown head
