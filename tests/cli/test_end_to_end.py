"""The whole path once: build-index and query from the CLI, the API under a real uvicorn, the UI page."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from bench.lib.images import image_bytes, make_image
from bench.lib.servers import free_port
from cli.main import app
from index.gallery import GalleryIndex
from tests.tiers import starts

runner = CliRunner()


def test_build_index_skips_corrupt_files_and_labels_by_folder(
    exported_model: Path, synthetic_gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    result = runner.invoke(
        app, ["build-index", str(synthetic_gallery), "--model", str(exported_model), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "indexed 9 images" in result.output
    assert "corrupt.jpg" in result.output  # reported, not fatal
    index = GalleryIndex.open(out)
    assert len(index) == 9
    assert index.manifest.count == 9
    assert index.manifest.dim == 1280
    labels = {index.items.get(i).label for i in range(1, 10)}
    assert labels == {"alpha", "beta", "gamma"}
    assert not list(tmp_path.glob(".index.*")), "staging directory left behind"


def test_build_index_names_the_files_it_indexed_once_as_copies(exported_model: Path, tmp_path: Path) -> None:
    gallery = tmp_path / "photos"
    (gallery / "cars").mkdir(parents=True)
    make_image(1).save(gallery / "cars" / "a.png")
    make_image(2).save(gallery / "cars" / "b.png")
    (gallery / "edited").mkdir()
    (gallery / "edited" / "a copy.png").write_bytes((gallery / "cars" / "a.png").read_bytes())
    out = tmp_path / "index"
    result = runner.invoke(
        app, ["build-index", str(gallery), "--model", str(exported_model), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "indexed 2 images" in result.output
    assert "edited/a copy.png: same content as cars/a.png (indexed once)" in result.output


def test_query_finds_the_image_itself_first(
    exported_model: Path, synthetic_gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    runner.invoke(
        app, ["build-index", str(synthetic_gallery), "--model", str(exported_model), "--out", str(out)]
    )
    query = synthetic_gallery / "gamma" / "gamma_1.png"
    result = runner.invoke(
        app, ["query", str(query), "--index", str(out), "--model", str(exported_model), "-k", "3", "--json"]
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert [r["rank"] for r in body["results"]] == [1, 2, 3]
    top = body["results"][0]
    assert top["path"] == "gamma/gamma_1.png"
    assert top["score"] == pytest.approx(1.0, abs=1e-4)
    scores = [r["score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


def test_query_with_a_different_model_is_a_clear_error(
    exported_model: Path, demo_index: Path, tmp_path: Path
) -> None:
    from engine.model.model_card import ModelCard

    other = tmp_path / "other.onnx"
    other.write_bytes(exported_model.read_bytes())
    card = ModelCard.load(exported_model)
    index_manifest = demo_index / "manifest.json"
    manifest = json.loads(index_manifest.read_text())
    # Same bytes, but an index that claims another model: the query must refuse it.
    tampered = tmp_path / "index"
    tampered.mkdir()
    for path in demo_index.iterdir():
        (tampered / path.name).write_bytes(path.read_bytes())
    manifest["model_fingerprint"] = "0" * 64
    (tampered / "manifest.json").write_text(json.dumps(manifest))
    card.save(other)
    result = runner.invoke(
        app, ["query", str(exported_model), "--index", str(tampered), "--model", str(other)]
    )
    assert result.exit_code == 2
    assert "rebuild the index" in result.output


@pytest.fixture(scope="module")
@starts("server")
def live_api(exported_model: Path, demo_index: Path) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli.main",
            "serve",
            "--index",
            str(demo_index),
            "--model",
            str(exported_model),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert process.poll() is None, "server exited"
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not become ready")
        yield base
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_api_search_returns_ranked_scored_results(live_api: str, demo_gallery: Path) -> None:
    query = (demo_gallery / "cat" / "00_crop.jpg").read_bytes()
    response = httpx.post(
        f"{live_api}/v1/search", params={"k": 5}, files={"image": ("q.jpg", query)}, timeout=30
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["results"]) == 5
    assert body["took_ms"] > 0
    assert all(result["label"] == "cat" for result in body["results"])
    assert body["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)
    image = httpx.get(f"{live_api}/v1/items/{body['results'][0]['id']}/image", timeout=10)
    assert image.status_code == 200
    assert image.content == query


def test_api_rejects_bad_uploads_with_json_errors_and_keeps_serving(live_api: str) -> None:
    bad = httpx.post(f"{live_api}/v1/search", files={"image": ("x.jpg", b"not an image")}, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "not_an_image"
    bad_k = httpx.post(
        f"{live_api}/v1/search",
        params={"k": 0},
        files={"image": ("x.png", image_bytes(make_image(1)))},
        timeout=30,
    )
    assert bad_k.status_code == 422
    assert "error" in bad_k.json()
    assert httpx.get(f"{live_api}/healthz", timeout=5).status_code == 200


def test_streamlit_page_shows_results_grid(live_api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("DMLSEARCH_API_URL", live_api)
    page = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app" / "ui.py"), default_timeout=60)
    page.run()
    assert not page.exception
    assert page.sidebar.metric[0].value == "78"


def test_a_warning_on_the_command_line_says_what_not_where() -> None:
    """What the engine skipped reaches the user as one line, without Python's file, line and source."""
    script = (
        "import warnings; from cli.main import _command_line; _command_line(); "
        "warnings.warn('skipped unreadable image a/bad.jpg: truncated', stacklevel=1)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stderr == "warning: skipped unreadable image a/bad.jpg: truncated\n"
