"""GET /v1/model and the UI's Model page: the served model's card, with its run's proof when present.

The full path (train -> report -> export -> serve) is tested in tests/training/test_proof.py; here the
served card points at a run directory holding an eval result and report plots, or at none.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.ui_model import NOT_APPLICABLE
from engine.model.model_card import ModelCard, ValidationCheck
from engine.model.run_proof import EVAL_FILE, PLOTS, plot_path
from tests.support.served import Served, copy_served
from tests.support.servers import uvicorn_server
from tests.tiers import starts
from training.comparison import compare_embeddings

PAGE = Path(__file__).resolve().parents[2] / "app" / "ui.py"
FORCED_DETAIL = "validation recall@1 70.00 at step 40 vs 68.00 untrained, ...: not distinguishable"


def _attach_run(model: Path, run: Path, *, best_step: int = 40, failure: str | None = None) -> dict:
    """Make ``run`` the served model's training run, with an eval result (a constructed better model)
    and one PNG per report plot, exported with --force (validation could not tell it from the untrained
    model, as on small folders); returns the eval result. ``best_step`` 0 and a ``failure``: a run that
    learned nothing, whose report has the training plot only."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 6)
    centres = rng.standard_normal((10, 16))
    trained = centres[labels] + 0.2 * rng.standard_normal((60, 16))
    untrained = centres[labels] + 3.0 * rng.standard_normal((60, 16))
    described = {"best_step": best_step, "failure": failure}
    evaluation = compare_embeddings(trained, untrained, labels, resamples=200, run=described).to_dict()
    run.mkdir(parents=True)
    (run / EVAL_FILE).write_text(json.dumps(evaluation))
    for number, name in enumerate(PLOTS if best_step else ["training"]):
        plot_path(run, name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (320, 200), (40 * number, 120, 200)).save(plot_path(run, name))
    (run / "report.html").write_text("<html></html>")
    card = ModelCard.load(model)
    extra = {
        "mode": "frozen",
        "recipe": "recommended",
        "trained": "2026-11-23T07:00:00+00:00",
        "best_step": best_step,
    }
    check = ValidationCheck(passed=False, detail=FORCED_DETAIL)
    update = {"loss": "magnet", "run": str(run), "extra": {**extra, "val": {"recall@1": 0.7}}}
    card.model_copy(update={**update, "validation_check": check}).save(model)
    return evaluation


def test_pretrained_model_has_a_card_and_no_report(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    card = client.get("/v1/model").json()
    assert card["fingerprint"] == client.get("/v1/stats").json()["model_fingerprint"]
    assert card["loss"] is None and card["run"] is None and card["recipe"] is None
    assert card["validation_check"] is None
    assert card["report_available"] is False and card["plots"] == [] and card["evaluation"] is None
    response = client.get("/v1/model/plots/training")
    assert response.status_code == 404
    assert "not on this server" in response.json()["error"]["message"]


def test_card_of_a_trained_model_lists_its_plots(
    served: Served, make_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    evaluation = _attach_run(served.model, tmp_path / "runs" / "magnet-1")
    client = make_client()
    card = client.get("/v1/model").json()
    assert (card["loss"], card["recipe"], card["mode"], card["run"]) == (
        "magnet",
        "recommended",
        "frozen",
        "magnet-1",
    )
    assert card["trained"] == "2026-11-23T07:00:00+00:00" and card["best_step"] == 40
    assert card["validation_check"] == {"passed": False, "detail": FORCED_DETAIL}
    assert card["evaluation"] == evaluation and card["evaluation"]["verdict"] == "better"
    assert [plot["name"] for plot in card["plots"]] == list(PLOTS)
    with Image.open(io.BytesIO(client.get(card["plots"][0]["url"]).content)) as image:
        assert image.size == (320, 200)
    # A run directory that is not on this server: the card still shows, without the proof.
    (tmp_path / "runs" / "magnet-1").rename(tmp_path / "runs" / "elsewhere")
    card = client.get("/v1/model").json()
    assert card["run"] == "magnet-1" and card["plots"] == [] and not card["report_available"]


@pytest.fixture(scope="module")
@starts("server")
def reported_api_url(
    tmp_path_factory: pytest.TempPathFactory, demo_gallery: Path, demo_index: Path, exported_model: Path
) -> Iterator[str]:
    target = tmp_path_factory.mktemp("reported")
    served = copy_served(demo_gallery, demo_index, exported_model, target)
    _attach_run(served.model, target / "runs" / "magnet-1")
    args = ["--index", str(served.index), "--model", str(served.model), "--rate-limit", "0"]
    with uvicorn_server(args) as url:
        yield url


def _model_page(api_url: str, monkeypatch: pytest.MonkeyPatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("DMLSEARCH_API_URL", api_url)
    page = AppTest.from_file(str(PAGE), default_timeout=60)
    page.run()
    page.sidebar.radio(key="page").set_value("Model")
    page.run()
    assert not page.exception
    return page


def test_model_page_shows_the_card_verdict_and_plots(
    reported_api_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = _model_page(reported_api_url, monkeypatch)
    table = page.table[0].value
    shown = dict(zip(table.iloc[:, 0], table.iloc[:, 1], strict=True))
    assert shown["Loss"] == "magnet" and shown["Recipe"] == "recommended" and shown["Run"] == "magnet-1"
    assert "**better**" in page.success[0].value
    (forced,) = [error.value for error in page.error]
    assert "failed the validation check and was exported with --force" in forced and FORCED_DETAIL in forced
    assert len(page.image) == len(PLOTS)
    assert [caption for image in page.image for caption in image.captions] == list(PLOTS.values())


@pytest.fixture(scope="module")
@starts("server")
def pretrained_api_url(exported_model: Path, demo_index: Path) -> Iterator[str]:
    args = ["--index", str(demo_index), "--model", str(exported_model), "--rate-limit", "0"]
    with uvicorn_server(args) as url:
        yield url


def test_model_page_of_the_pretrained_backbone(
    pretrained_api_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No run: the fields it lacks read as not applicable (a bare "-" was drawn as a markdown bullet) and
    the page says why there is no report instead of asking for one."""
    page = _model_page(pretrained_api_url, monkeypatch)
    table = page.table[0].value
    shown = dict(zip(table.iloc[:, 0], table.iloc[:, 1], strict=True))
    assert shown["Loss"] == "none (pretrained backbone)"
    for field in ("Recipe", "Mode", "Trained", "Run", "Selected step"):
        assert shown[field] == NOT_APPLICABLE, field
    assert not [value for value in shown.values() if value.strip() in {"-", "*", "+"}]  # markdown bullets
    assert "pretrained backbone, untrained" in page.info[0].value
    assert "dmlsearch report RUN` on the run it was exported from" not in page.info[0].value
    assert len(page.image) == 0


LEARNED_NOTHING = "the magnet loss was 0 at 7 of the last 8 steps, so nothing was learned"


@pytest.fixture(scope="module")
@starts("server")
def failed_api_url(
    tmp_path_factory: pytest.TempPathFactory, demo_gallery: Path, demo_index: Path, exported_model: Path
) -> Iterator[str]:
    target = tmp_path_factory.mktemp("failed")
    served = copy_served(demo_gallery, demo_index, exported_model, target)
    _attach_run(served.model, target / "runs" / "magnet-0", best_step=0, failure=LEARNED_NOTHING)
    args = ["--index", str(served.index), "--model", str(served.model), "--rate-limit", "0"]
    with uvicorn_server(args) as url:
        yield url


def test_model_page_of_a_run_that_learned_nothing_says_so_and_why(
    failed_api_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44: a run whose best checkpoint is step 0 is not presented as training (its eval's "better"
    verdict compares the head it started from): the page says that it learned nothing, and why."""
    page = _model_page(failed_api_url, monkeypatch)
    errors = [re.sub(r"\\(.)", r"\1", error.value) for error in page.error]  # Markdown escapes undone
    assert any(f"learned nothing in training: {LEARNED_NOTHING}" in error for error in errors), errors
    assert not page.success  # no verdict box
    assert [caption for image in page.image for caption in image.captions] == [PLOTS["training"]]
