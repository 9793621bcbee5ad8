"""Proof before promotion: the bootstrap interval, the eval verdict, kNC accuracy, the export refusal."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from typer.testing import CliRunner

from app.api import create_app
from app.settings import Settings
from cli.main import app
from engine.build.indexing import build_index
from engine.model.embedder import Embedder
from engine.model.run_proof import EVAL_FILE, PLOTS, REPORT_FILE, plot_path
from tests.support.train_config import tiny_train_config
from training.bootstrap import Interval, paired_bootstrap
from training.comparison import compare_embeddings, knc_accuracy, serving_check, validation_gain
from training.run_dir import RunDirectory
from training.trainer import train

runner = CliRunner()

CLASSES, PER_CLASS, DIM = 20, 10, 32


def _embeddings(spread: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Items around one random centre per class: small ``spread`` separates the classes, large mixes them."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    centres = rng.standard_normal((CLASSES, DIM))
    return centres[labels] + spread * rng.standard_normal((len(labels), DIM)), labels


def test_bootstrap_interval_matches_the_normal_approximation() -> None:
    rng = np.random.default_rng(0)
    first, second = rng.random(4000) < 0.7, rng.random(4000) < 0.6
    interval = paired_bootstrap(first, second, resamples=2000, seed=1)
    difference = first.astype(float) - second
    half_width = 1.96 * difference.std(ddof=1) / np.sqrt(len(difference))
    assert interval.difference == pytest.approx(difference.mean())
    assert interval.low == pytest.approx(difference.mean() - half_width, abs=0.004)
    assert interval.high == pytest.approx(difference.mean() + half_width, abs=0.004)
    assert interval.verdict == "better" and paired_bootstrap(second, first).verdict == "worse"


@pytest.mark.parametrize(
    ("trained_spread", "untrained_spread", "verdict"),
    [(0.2, 3.0, "better"), (1.0, 1.0, "not distinguishable"), (3.0, 0.2, "worse")],
)
def test_eval_verdict_on_constructed_models(
    trained_spread: float, untrained_spread: float, verdict: str
) -> None:
    trained, labels = _embeddings(trained_spread, seed=0)
    untrained, _ = _embeddings(untrained_spread, seed=0)
    if trained_spread == untrained_spread:
        untrained = trained.copy()  # the same model: every query answered alike
    comparison = compare_embeddings(trained, untrained, labels, resamples=500)
    interval = comparison.recall_at_1
    assert comparison.verdict == verdict
    assert interval.difference == pytest.approx(
        comparison.trained["recall@1"] - comparison.untrained["recall@1"]
    )
    assert interval.low <= interval.difference <= interval.high
    if verdict == "not distinguishable":
        assert interval.low == interval.high == 0.0
    else:
        assert abs(interval.difference) > 0.3
    assert comparison.knc is None
    assert json.loads(json.dumps(comparison.to_dict()))["verdict"] == verdict


def test_knc_accuracy_separates_clustered_from_mixed_embeddings() -> None:
    separated, labels = _embeddings(0.2, seed=0)
    mixed, _ = _embeddings(5.0, seed=0)
    assert knc_accuracy(separated, labels, clusters_per_class=2) == 1.0
    assert knc_accuracy(mixed, labels, clusters_per_class=2) < 0.5
    comparison = compare_embeddings(separated, mixed, labels, knc_clusters=2, resamples=200)
    assert comparison.knc == {"trained": 1.0, "untrained": knc_accuracy(mixed, labels, clusters_per_class=2)}


def _run(folder: Path, cache: Path, out: Path, loss: str, max_steps: int) -> Path:
    train(tiny_train_config(folder, cache, loss=loss, max_steps=max_steps, eval_every=2), out, progress=False)
    return out


@pytest.fixture(scope="module")
def magnet_run(labelled_folder: Path, feature_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(labelled_folder, feature_cache, tmp_path_factory.mktemp("magnet") / "run", "magnet", 4)


def test_cli_eval_compares_a_run_with_the_untrained_backbone(magnet_run: Path) -> None:
    result = runner.invoke(app, ["eval", str(magnet_run), "--json", "--resamples", "300"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown == json.loads((magnet_run / EVAL_FILE).read_text())
    summary = RunDirectory(magnet_run).read_summary()
    assert shown["trained"]["recall@1"] == summary.test["recall@1"]
    assert shown["untrained"]["recall@1"] == summary.test_backbone["recall@1"]
    assert shown["verdict"] in ("better", "not distinguishable", "worse")
    assert set(shown["knc_accuracy"]) == {"trained", "untrained"}
    assert shown["run"]["loss"] == "magnet" and shown["images"] == 30

    result = runner.invoke(app, ["eval", str(magnet_run), "--resamples", "300"])
    assert result.exit_code == 0, result.output
    assert f"verdict: {shown['verdict']}" in result.output
    assert "kNC accuracy (Magnet Eq. 6)" in result.output and "95% CI" in result.output


def test_export_refuses_a_run_no_better_than_untrained_unless_forced(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    run = _run(labelled_folder, feature_cache, tmp_path / "run", "contrastive", 0)  # never trained
    gain = validation_gain(run)
    assert gain.best_step == 0 and not gain.improved
    result = runner.invoke(app, ["export", str(run)])
    assert result.exit_code == 2
    assert "not better than the untrained model on validation" in result.output
    assert "--force" in result.output and not (run / "model.onnx").exists()
    result = runner.invoke(app, ["export", str(run), "--force"])
    assert result.exit_code == 0, result.output
    assert (run / "model.onnx").exists()


def _with_recorded_gain(run_path: Path, copy: Path, interval: Interval) -> Path:
    """A copy of the run whose summary records ``interval`` for a trained step (known whatever the tiny run
    learned)."""
    shutil.copytree(run_path, copy)
    run = RunDirectory(copy)
    summary = run.read_summary()
    run.write_summary(summary.model_copy(update={"best_step": 2, "validation_gain": interval}))
    return copy


@pytest.mark.parametrize(
    ("interval", "exit_code"),
    [
        (Interval(0.30, 0.10, 0.50, 0.95, 2000), 0),  # better: the whole interval above zero
        (Interval(0.04, -0.02, 0.10, 0.95, 2000), 2),  # higher, but validation cannot tell it from noise
    ],
)
def test_export_accepts_only_a_run_better_than_untrained_on_validation(
    magnet_run: Path, tmp_path: Path, interval: Interval, exit_code: int
) -> None:
    run = _with_recorded_gain(magnet_run, tmp_path / "run", interval)
    assert validation_gain(run).improved == (exit_code == 0)
    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "model.onnx")])
    assert result.exit_code == exit_code, result.output
    if exit_code:
        assert "not distinguishable" in result.output and "95% CI [-2.00, +10.00]" in result.output


def test_validation_gain_of_a_run_without_the_record_is_computed_as_the_trainer_did(
    magnet_run: Path, tmp_path: Path
) -> None:
    recorded = validation_gain(magnet_run)
    summary = RunDirectory(magnet_run).read_summary()
    assert recorded.interval == summary.validation_gain
    assert recorded.improved == summary.beats_backbone
    copy = tmp_path / "run"
    shutil.copytree(magnet_run, copy)
    # As a run finished before the trainer recorded it.
    RunDirectory(copy).write_summary(summary.model_copy(update={"validation_gain": None}))
    assert validation_gain(copy) == recorded


@pytest.fixture(scope="module")
def report_output(magnet_run: Path) -> str:
    result = runner.invoke(app, ["report", str(magnet_run), "--resamples", "200"])
    assert result.exit_code == 0, result.output
    return result.output


def test_report_is_one_self_contained_page_of_plots(magnet_run: Path, report_output: str) -> None:
    result = SimpleNamespace(output=report_output)
    page = (magnet_run / REPORT_FILE).read_text()
    assert f"wrote {magnet_run / REPORT_FILE}" in result.output
    # Every plot is embedded as a PNG and also written beside the page for the API.
    images = re.findall(r"<img alt='(\w+)' src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert [name for name, _ in images] == list(PLOTS)
    for name, encoded in images:
        data = base64.b64decode(encoded)
        assert data == plot_path(magnet_run, name).read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "PNG" and image.width > 300 and image.height > 150
    # Self-contained: nothing is fetched from elsewhere.
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", page, flags=re.IGNORECASE)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    shown = json.loads((magnet_run / EVAL_FILE).read_text())
    assert f"<b>{shown['verdict']}</b>" in page
    assert f"{100 * shown['trained']['recall@1']:.2f}" in page and "kNC accuracy" in page
    assert "magnet" in page
    served = serving_check(magnet_run)  # the report says what export would do, whatever the verdict
    assert f"<dt>served</dt><dd>{'yes' if served.passed else 'no'}: `dmlsearch export`" in page


def test_a_refused_run_better_on_its_test_images_is_not_shown_as_an_improvement(
    magnet_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new-user trial of issue 39: a label-free run better on its test photos' first check, refused by
    the gate, got a green "better" banner under "served: no", and `report` printed "verdict: better". A run
    export refuses is never presented as an improvement: the banner and the command say it is not served."""
    import training.comparison

    run = _with_recorded_gain(magnet_run, tmp_path / "run", Interval(0.04, -0.02, 0.10, 0.95, 2000))
    assert not serving_check(run).passed
    measured = training.comparison.compare_run

    def better_on_test(*args: object, **kwargs: object) -> object:
        comparison, embedded = measured(*args, **kwargs)
        return replace(comparison, recall_at_1=Interval(0.04, 0.01, 0.08, 0.95, 200)), embedded

    monkeypatch.setattr(training.comparison, "compare_run", better_on_test)
    result = runner.invoke(app, ["report", str(run), "--resamples", "200"])
    assert result.exit_code == 0, result.output
    assert "verdict: better (trained vs the untrained backbone)" in result.output
    assert "not served: `dmlsearch export` refuses it" in result.output
    page = (run / REPORT_FILE).read_text()
    assert "class='verdict better'" not in page and "<b>better</b>" in page
    assert "but it is <b>not served</b>" in page


def test_report_of_a_missing_run_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "not a training run" in result.output


def test_served_model_shows_its_runs_card_and_report(
    magnet_run: Path, report_output: str, labelled_folder: Path, tmp_path: Path
) -> None:
    """train -> report -> export -> build-index -> serve: GET /v1/model carries the run's proof."""
    model = tmp_path / "model" / "model.onnx"
    result = runner.invoke(app, ["export", str(magnet_run), "--out", str(model), "--force"])
    assert result.exit_code == 0, result.output
    build_index(labelled_folder, Embedder(model), tmp_path / "index", progress=False)
    settings = Settings(index_path=tmp_path / "index", model_path=model, threads=1, rate_limit_per_second=0)
    with TestClient(create_app(settings)) as client:
        card = client.get("/v1/model").json()
        assert card["loss"] == "magnet" and card["mode"] == "frozen" and card["run"] == magnet_run.name
        assert card["fingerprint"] == Embedder(model).fingerprint and card["embedding_dim"] == 16
        assert card["trained"] and card["exported"] and card["best_step"] is not None
        assert card["validation"]["recall@1"] == RunDirectory(magnet_run).require_best().val["recall@1"]
        assert card["evaluation"] == json.loads((magnet_run / EVAL_FILE).read_text())
        assert card["report_available"] and [plot["name"] for plot in card["plots"]] == list(PLOTS)
        for plot in card["plots"]:
            response = client.get(plot["url"])
            assert response.status_code == 200 and response.headers["content-type"] == "image/png"
            assert response.content == plot_path(magnet_run, plot["name"]).read_bytes()
        response = client.get("/v1/model/plots/secrets")
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("trained_noise", [0.0, 0.6], ids=["equal curves", "crossing curves"])
def test_recall_curve_labels_stay_apart_and_inside(trained_noise: float) -> None:
    """Recall@K labels of close or crossing curves (a run that changed little) never overlap each other,
    and stay inside the plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from training.report import recall_figure

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(8), 5)
    untrained = rng.standard_normal((8, 16))[labels] + 0.8 * rng.standard_normal((40, 16))
    trained = untrained + trained_noise * rng.standard_normal((40, 16))
    figure = recall_figure(SimpleNamespace(trained=trained, untrained=untrained, labels=labels))
    renderer = FigureCanvasAgg(figure).get_renderer()
    axes = figure.axes[0]
    boxes = [text.get_window_extent(renderer) for text in axes.texts]
    assert len(boxes) == 2 * 6  # both curves, K = 1 ... 32
    assert [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)] == []
    frame = axes.get_window_extent(renderer)
    assert all(frame.y0 <= box.y0 and box.y1 <= frame.y1 for box in boxes)


def test_the_t_sne_map_has_a_legend_of_the_largest_classes_and_other() -> None:
    from training.evaluation import RunEmbeddings
    from training.report import LEGEND_CLASSES, embedding_figure

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(25), np.arange(25) % 4 + 3)  # 25 classes of 3 to 6 images
    vectors = rng.normal(size=(len(labels), 8)).astype(np.float32)
    names = tuple(f"class {label}" for label in range(25))
    embedded = RunEmbeddings(None, None, vectors, vectors, labels, [], names)  # type: ignore[arg-type]
    (legend,) = embedding_figure(embedded).legends
    shown = [text.get_text() for text in legend.get_texts()]
    largest = [f"class {label}" for label in (3, 7, 11, 15, 19, 23, 2, 6, 10, 14)]  # 6 images, then 5
    assert shown == [*largest, "other (15 classes)"] and LEGEND_CLASSES == 10
    small = RunEmbeddings(None, None, vectors[:9], vectors[:9], labels[:9], [], names)  # type: ignore[arg-type]
    (legend,) = embedding_figure(small).legends
    assert [text.get_text() for text in legend.get_texts()] == ["class 1", "class 0", "class 2"]
