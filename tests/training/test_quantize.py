"""int8 export: static QDQ quantisation calibrated on gallery images, recorded in model.json, near fp32."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.decode.images import load_image_file
from engine.gallery.files import list_images
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from training.quantize import calibration_files, quantize_int8

runner = CliRunner()
CALIBRATION = 40


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory: pytest.TempPathFactory, demo_gallery: Path) -> Path:
    out = tmp_path_factory.mktemp("int8") / "model.onnx"
    result = runner.invoke(
        app,
        [
            *("export", "--out", str(out), "--int8"),
            *("--calibration", str(demo_gallery), "--calibration-count", str(CALIBRATION)),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"int8 calibrated on {CALIBRATION} images" in result.output
    return out


def _embed_gallery(model: Path, files: list[Path]) -> np.ndarray:
    embedder = Embedder(model, threads=1)
    draft = embedder.card.preprocessing.resize_size
    return embedder.embed([load_image_file(path, draft_size=draft) for path in files])


def _top(vectors: np.ndarray, k: int) -> np.ndarray:
    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)  # each image queries all the others
    return np.argsort(-similarity, axis=1)[:, :k]


def test_the_card_records_precision_and_calibration(int8_model: Path, exported_model: Path) -> None:
    card, fp32 = ModelCard.load(int8_model), ModelCard.load(exported_model)
    assert (card.precision, card.calibration_images) == ("int8", CALIBRATION)
    assert (fp32.precision, fp32.calibration_images) == ("fp32", None)
    assert card.fingerprint != fp32.fingerprint  # an fp32 index is refused by the int8 model
    assert card.embedding_dim == fp32.embedding_dim and card.preprocessing == fp32.preprocessing
    graph = onnx.load(str(int8_model)).graph
    ops = {node.op_type for node in graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    int8_weights = [t for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert sum(int(np.prod(t.dims)) for t in int8_weights) > 3_000_000  # the backbone's weights are int8


def test_int8_retrieval_stays_close_to_fp32(
    int8_model: Path, exported_model: Path, demo_gallery: Path
) -> None:
    files = list_images(demo_gallery)
    fp32, int8 = _embed_gallery(exported_model, files), _embed_gallery(int8_model, files)
    np.testing.assert_allclose(np.linalg.norm(int8, axis=1), 1.0, atol=1e-5)
    cosines = (fp32 * int8).sum(axis=1)
    assert cosines.mean() > 0.98 and cosines.min() > 0.9
    # Retrieval, not bit parity, is what int8 must keep: the top-5 neighbours of each gallery image.
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(_top(fp32, 5), _top(int8, 5), strict=True)])
    # Recall@1 by label (the photo each variant was made from): int8 may swap two variants of one photo,
    # not lose the photo.
    labels = np.array([path.parent.name for path in files])
    recall = {
        name: np.mean(labels[_top(v, 1)[:, 0]] == labels) for name, v in (("fp32", fp32), ("int8", int8))
    }
    print(f"cosine mean {cosines.mean():.4f} min {cosines.min():.4f}, top-5 overlap {overlap:.3f}, {recall}")
    assert overlap >= 0.8
    assert recall["int8"] >= recall["fp32"] - 2 / len(files)


def test_int8_sessions_use_exact_kernels_on_cpus_without_vnni(int8_model: Path) -> None:
    # Without it an AVX2-only CPU sums u8 x s8 products in saturating 16 bits: cosine to fp32 fell to 0.89.
    options = Embedder(int8_model, threads=1).session.get_session_options()
    assert options.get_session_config_entry("session.x64quantprecision") == "1"


def test_quantising_twice_is_refused(int8_model: Path, demo_gallery: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model.onnx"
    shutil.copy(int8_model, copy)
    shutil.copy(int8_model.with_suffix(".json"), copy.with_suffix(".json"))
    with pytest.raises(ValueError, match="already int8"):
        quantize_int8(copy, calibration_files(demo_gallery, 4))


@pytest.mark.parametrize(
    ("calibration", "message"), [(None, "--int8 needs --calibration"), ("empty", "no images under")]
)
def test_cli_int8_without_calibration_images_exits_2(
    tmp_path: Path, calibration: str | None, message: str
) -> None:
    args = ["export", "--out", str(tmp_path / "m" / "model.onnx"), "--int8"]
    if calibration is not None:
        (tmp_path / calibration).mkdir()
        args += ["--calibration", str(tmp_path / calibration)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_the_int8_model_keeps_its_explainer(int8_model: Path, demo_gallery: Path) -> None:
    """The feature map survives quantisation as the second output, and the (float) explainer splits the
    int8 model's served cosines over positions within the int8 maps' rounding."""
    from engine.model.explainer import Explainer

    embedder = Embedder(int8_model, threads=1)
    assert embedder.card.explainer is not None
    batch = embedder.preprocess([load_image_file(path) for path in list_images(demo_gallery)[:6]])
    served = embedder.embed_tensor(batch)
    _, maps = embedder.embed_with_maps(batch)
    contributions, rest = Explainer.for_model(int8_model, embedder.card).split(maps)
    totals = np.einsum("ahwd,bd->ab", contributions, served) + rest @ served.T
    np.testing.assert_allclose(totals, served @ served.T, atol=2e-3)
