"""The Streamlit page against a live API: Streamlit's AppTest, and a real browser (Playwright + chromium)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from bench.lib.servers import free_port
from tests.support.servers import uvicorn_server
from tests.tiers import starts

PAGE = Path(__file__).resolve().parents[2] / "app" / "ui.py"
CHROMIUM = Path("/usr/bin/chromium")
# Set DMLSEARCH_UI_SCREENSHOT to a file path to keep the browser test's screenshot there.
SCREENSHOT_COPY = os.environ.get("DMLSEARCH_UI_SCREENSHOT")
RESULT_CAPTION = re.compile(r" · (\S+\.jpg)$")


@pytest.fixture(scope="module")
@starts("server")
def api_url(exported_model: Path, demo_index: Path) -> Iterator[str]:
    args = ["--index", str(demo_index), "--model", str(exported_model), "--rate-limit", "0"]
    with uvicorn_server(args) as url:
        yield url


@pytest.fixture
def page(api_url: str, monkeypatch: pytest.MonkeyPatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("DMLSEARCH_API_URL", api_url)
    app_test = AppTest.from_file(str(PAGE), default_timeout=60)
    app_test.run()
    assert not app_test.exception
    return app_test


def texts(elements) -> list[str]:
    """The elements' text as the browser shows it: labels and paths are sent with their Markdown escaped."""
    return [re.sub(r"\\(.)", r"\1", element.value) for element in elements]


def test_upload_shows_a_scored_grid_and_the_sidebar_stats(page, demo_gallery: Path) -> None:
    assert page.sidebar.metric[0].value == "78"
    page.sidebar.slider[0].set_value(8)
    page.file_uploader[0].set_value(
        ("cat.jpg", (demo_gallery / "cat/00_crop.jpg").read_bytes(), "image/jpeg")
    )
    page.run()
    assert not page.exception
    scores = [text for text in texts(page.markdown) if "score" in text]
    assert len(scores) == 8
    assert scores[0] == "**#1 · score 1.000**"
    assert any("cat/00_crop.jpg" in caption for caption in texts(page.caption))
    assert len(page.image) == 8 + 1  # the results' thumbnails and the query
    assert "Predicted label: **cat**" in page.success[0].value


def _odd_uploads() -> dict[str, bytes]:
    import numpy as np
    from PIL import Image

    from bench.lib.images import image_bytes, make_image

    exif = Image.Exif()
    exif[0x0112] = 6
    grey16 = Image.fromarray(np.arange(96 * 80, dtype=np.uint16).reshape(80, 96) * 8)
    floats = Image.fromarray(np.linspace(0, 1, 96 * 80, dtype=np.float32).reshape(80, 96), "F")
    return {
        "lab.tiff": image_bytes(make_image(4).convert("LAB"), "TIFF"),
        "float.tiff": image_bytes(floats, "TIFF"),
        "grey16.png": image_bytes(grey16, "PNG"),
        "rotated.jpg": image_bytes(make_image(5, (120, 60)), "JPEG", exif=exif.tobytes()),
    }


@pytest.mark.parametrize("name", ["lab.tiff", "float.tiff", "grey16.png", "rotated.jpg"])
def test_every_image_the_api_accepts_is_shown(page, name: str) -> None:
    """Before: LAB, float and 16-bit grey uploads crashed the page with a traceback naming server paths
    ("cannot write mode LAB as JPEG"); the preview is now a JPEG the page makes (app/ui_display.py)."""
    page.file_uploader[0].set_value((name, _odd_uploads()[name], "application/octet-stream"))
    page.run()
    assert not page.exception
    assert [caption for image in page.image for caption in image.captions if caption == "query"] == ["query"]


def test_bad_upload_gets_a_clear_message(page) -> None:
    page.file_uploader[0].set_value(("notes.jpg", b"this is a text file, not a photo", "image/jpeg"))
    page.run()
    assert not page.exception
    assert "not a recognised image format" in page.error[0].value


def test_a_hostile_upload_is_never_decoded_in_the_pages_process(
    page, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43, class 8. Before, the page made its preview with Pillow in its own process: a small WebP
    declaring 49 MP took it to 971 MB (750 MB more, here the test's process), with no CPU limit at all.
    Now the preview is made in a decode process: the upload's bytes never reach Pillow here."""
    import io

    from PIL import Image

    from bench.lib.hostile_images import LEGIT

    upload = LEGIT["webp-lossless-RGBA-49mp"]()
    opened_here: list[int] = []
    real_open = Image.open

    def watched_open(source, *args, **kwargs):
        if isinstance(source, io.BytesIO) and source.getvalue() == upload:
            opened_here.append(len(upload))
        return real_open(source, *args, **kwargs)

    monkeypatch.setattr(Image, "open", watched_open)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    page.file_uploader[0].set_value(("big.webp", upload, "image/webp"))
    page.run()
    assert not page.exception
    assert opened_here == []
    assert _peak_growth_mb() < 150
    assert [caption for image in page.image for caption in image.captions if caption == "query"] == ["query"]


def _peak_growth_mb() -> float:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return (int(status["VmHWM"].split()[0]) - int(status["VmRSS"].split()[0])) / 1024


def test_an_upload_over_the_decode_limits_is_refused_with_the_reason_and_not_searched(page) -> None:
    """Hostile: a 7000x7000 progressive JPEG whose one scan repeats 1,000 times (21-24 s of CPU to decode).
    Before, the page decoded it itself for its preview (a 10,000-scan one: 165 s of this process's CPU,
    going on after the browser closed). Now its decode process stops at the 5 s CPU limit and the page
    says why, without sending it to the API."""
    from bench.lib.hostile_images import jpeg_repeated_scan

    page.file_uploader[0].set_value(("scans.jpg", jpeg_repeated_scan(1000), "image/jpeg"))
    page.run()
    assert not page.exception
    assert "cannot be shown or searched" in page.error[0].value
    assert "s of CPU" in page.error[0].value
    assert not [text for text in texts(page.markdown) if "score" in text]


def test_clicking_a_result_searches_by_it(page, demo_gallery: Path) -> None:
    page.file_uploader[0].set_value(
        ("coffee.jpg", (demo_gallery / "coffee/01_crop.jpg").read_bytes(), "image/jpeg")
    )
    page.run()
    second = [button for button in page.button if button.key.startswith("similar-")][1]
    clicked_id = int(second.key.removeprefix("similar-"))
    second.click()
    page.run()
    assert not page.exception
    assert page.radio[0].value == "Pick a gallery item"
    assert page.selectbox[0].value == clicked_id
    captions = [caption for image in page.image for caption in image.captions]
    assert f"query: item {clicked_id}" in captions
    assert [text for text in texts(page.markdown) if "score" in text]


def test_a_result_shows_why_it_matched_when_asked(page, demo_gallery: Path) -> None:
    page.file_uploader[0].set_value(
        ("coffee.jpg", (demo_gallery / "coffee/01_crop.jpg").read_bytes(), "image/jpeg")
    )
    page.run()
    captions = [caption for image in page.image for caption in image.captions]
    assert not [caption for caption in captions if caption.startswith("why:")]  # only when asked
    page.toggle[1].set_value(True)  # the second result's
    page.run()
    assert not page.exception and not page.warning
    captions = [caption for image in page.image for caption in image.captions]
    why = [caption for caption in captions if caption.startswith("why:")]
    assert why == ["why: query", "why: result"]
    (summary,) = [text for text in texts(page.caption) if text.startswith("Similarity ")]
    assert "of the match" in summary and "positions" not in summary, summary


def _result_ids(page) -> list[int]:
    """The results' ids in rank order (each result's "Similar" button is keyed by it)."""
    keys = [button.key for button in page.button if button.key.startswith("similar-")]
    return [int(key.removeprefix("similar-")) for key in keys]


def test_thumbs_up_and_down_then_refine_search_again_by_them(page, api_url: str, demo_gallery: Path) -> None:
    data = (demo_gallery / "cat/00_crop.jpg").read_bytes()
    page.file_uploader[0].set_value(("cat.jpg", data, "image/jpeg"))
    page.run()
    plain = _result_ids(page)
    liked, disliked = plain[1], plain[2]
    page.button(key=f"judge-1-{liked}").click()
    page.run()
    page.button(key=f"judge--1-{disliked}").click()
    page.run()
    assert not page.exception
    assert "**Your judgments:** 👍 1 · 👎 1" in texts(page.markdown)
    assert _result_ids(page) == plain  # judged, not refined yet

    def api_answer(strategy: str) -> list[int]:
        params = {"k": 12, "min_score": 0.0, "predict": True, "positive": [liked], "negative": [disliked]}
        files = {"image": ("cat.jpg", data)}
        body = httpx.post(f"{api_url}/v1/search", params={**params, "strategy": strategy}, files=files).json()
        return [result["id"] for result in body["results"]]

    page.button(key="refine").click()
    page.run()
    assert not page.exception
    refined = _result_ids(page)
    assert liked not in refined and disliked not in refined
    assert refined == api_answer("average_vector") != plain
    # The query and its judgments stay on the page.
    captions = [caption for image in page.image for caption in image.captions]
    assert {"query", f"👍 item {liked}", f"👎 item {disliked}"} <= set(captions)
    assert any(caption.startswith("Results refined by 2 judgment(s)") for caption in texts(page.caption))
    page.sidebar.selectbox(key="strategy").set_value("best_score")
    page.run()
    assert _result_ids(page) == api_answer("best_score")
    page.button(key="clear-judgments").click()
    page.run()
    assert _result_ids(page) == plain
    assert "**Your judgments:** 👍 1 · 👎 1" not in texts(page.markdown)


@pytest.fixture
@starts("server")
def writable_api_url(
    tmp_path: Path, demo_gallery: Path, demo_index: Path, exported_model: Path
) -> Iterator[str]:
    """A served copy of the demo index that takes writes with the API key ``k3y``."""
    from tests.support.served import copy_served

    served = copy_served(demo_gallery, demo_index, exported_model, tmp_path)
    args = [
        "--index",
        str(served.index),
        "--model",
        str(served.model),
        "--rate-limit",
        "0",
        "--api-key",
        "k3y",
    ]
    with uvicorn_server(args) as url:
        yield url


def test_with_the_api_key_each_judgment_is_kept_by_the_server(
    writable_api_url: str, monkeypatch: pytest.MonkeyPatch, demo_gallery: Path
) -> None:
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("DMLSEARCH_API_URL", writable_api_url)
    page = AppTest.from_file(str(PAGE), default_timeout=60)
    page.run()
    page.sidebar.text_input(key="feedback_api_key").input("k3y")
    data = (demo_gallery / "cat/00_crop.jpg").read_bytes()
    page.file_uploader[0].set_value(("cat.jpg", data, "image/jpeg"))
    page.run()
    ids = _result_ids(page)

    def kept() -> list[tuple[int, int]]:
        body = httpx.get(f"{writable_api_url}/v1/feedback").json()
        assert all(j["query_item"] is None and j["query_hash"] for j in body["judgments"])
        return [(judgment["result"], judgment["sign"]) for judgment in body["judgments"]]

    for key in (f"judge-1-{ids[1]}", f"judge--1-{ids[2]}"):
        page.button(key=key).click()
        page.run()
    assert not page.exception and not page.warning
    assert kept() == [(ids[1], 1), (ids[2], -1)]
    for key in (f"judge-1-{ids[1]}", f"judge-1-{ids[2]}"):  # taken back; changed to 👍
        page.button(key=key).click()
        page.run()
    assert kept() == [(ids[2], 1)]
    assert "**Your judgments:** 👍 1 · 👎 0" in texts(page.markdown)
    # A key the server refuses: the judgment still refines this page, and a warning says it was not kept.
    page.sidebar.text_input(key="feedback_api_key").input("wrong")
    page.run()
    page.button(key=f"judge--1-{ids[3]}").click()
    page.run()
    assert "could not be kept by the server" in page.warning[0].value
    assert "**Your judgments:** 👍 1 · 👎 1" in texts(page.markdown)
    assert kept() == [(ids[2], 1)]


def test_min_score_slider_filters_results(page, demo_gallery: Path) -> None:
    page.sidebar.slider[1].set_value(0.99)
    page.file_uploader[0].set_value(
        ("cat.jpg", (demo_gallery / "cat/00_crop.jpg").read_bytes(), "image/jpeg")
    )
    page.run()
    scores = [text for text in texts(page.markdown) if "score" in text]
    assert scores == ["**#1 · score 1.000**"]


def test_duplicates_page_shows_groups_with_thumbnails_and_scores(page) -> None:
    page.sidebar.radio(key="page").set_value("Duplicates")
    page.run()
    assert not page.exception
    groups = [text for text in texts(page.markdown) if text.startswith("**Group ")]
    assert groups and groups[0].startswith("**Group 1** · ")
    scores = [caption for caption in texts(page.caption) if caption.startswith("score ")]
    assert len(page.image) == len(scores) >= 2 * len(groups)
    assert any("cat/00_original.jpg" in caption for caption in scores)
    page.checkbox(key="dup_custom").check()
    page.run()
    page.slider(key="dup_threshold").set_value(1.0)
    page.run()
    assert not page.exception
    assert "No near-duplicates on this page." in texts(page.info)


def test_sidebar_filters_restrict_the_results(page, demo_gallery: Path) -> None:
    # Every label of the index is offered (from /v1/labels, not from a page of items).
    assert page.sidebar.multiselect(key="filter_labels").options == sorted(
        path.name for path in demo_gallery.iterdir() if path.is_dir()
    )
    page.sidebar.multiselect(key="filter_labels").select("coffee")
    page.file_uploader[0].set_value(
        ("cat.jpg", (demo_gallery / "cat/00_crop.jpg").read_bytes(), "image/jpeg")
    )
    page.run()
    assert not page.exception
    paths = [caption for caption in texts(page.caption) if " · " in caption and "/" in caption]
    assert paths and all(caption.startswith("coffee · coffee/") for caption in paths)
    page.sidebar.multiselect(key="filter_labels").unselect("coffee")
    page.sidebar.text_input(key="filter_prefix").input("rocket/")
    page.run()
    paths = [caption for caption in texts(page.caption) if " · " in caption and "/" in caption]
    assert paths and all(" · rocket/" in caption for caption in paths)
    # Only rocket photos vote: the prediction says so instead of looking certain.
    assert page.success[0].value.endswith("of the vote, among the results within the filters)")
    page.sidebar.text_input(key="filter_prefix").input("no-such-folder/")
    page.run()
    assert texts(page.info) == ["No gallery image within the filters scored at least the minimum score."]


def test_search_controls_show_on_the_search_page_only_and_keep_their_values(page) -> None:
    page.sidebar.slider[0].set_value(5)
    page.sidebar.text_input(key="filter_prefix").input("rocket/")
    page.run()
    page.sidebar.radio(key="page").set_value("Duplicates")
    page.run()
    assert not page.exception
    # The filters do not apply to duplicates: a user must not think they do.
    assert not page.sidebar.text_input and [slider.label for slider in page.sidebar.slider] == []
    page.sidebar.radio(key="page").set_value("Search")
    page.run()
    assert not page.exception and not page.warning
    assert page.sidebar.text_input(key="filter_prefix").value == "rocket/"
    assert page.sidebar.slider[0].value == 5


@pytest.fixture
@starts("server")
def streamlit_url(api_url: str) -> Iterator[str]:
    """``dmlsearch ui`` (it becomes ``streamlit run app/ui.py``) on a free port, talking to the live API."""
    port = free_port()
    command = [sys.executable, "-m", "cli.main", "ui", "--api-url", api_url, "--port", str(port)]
    process = subprocess.Popen(command, env={**os.environ, "DMLSEARCH_MAX_UPLOAD_BYTES": str(5 * 2**20)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "streamlit exited"
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "streamlit did not start"
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture
def sync_api() -> ModuleType:
    """Playwright's sync API, or a skip saying what to install (checked before any server starts)."""
    module = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
    )
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    return module


@pytest.mark.browser
def test_real_browser_upload_shows_the_result_grid(
    sync_api: ModuleType, streamlit_url: str, demo_gallery: Path, tmp_path: Path
) -> None:
    query = demo_gallery / "cat/00_crop.jpg"
    screenshot = tmp_path / "ui.png"
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            view = browser.new_page(viewport={"width": 1400, "height": 1900})
            view.goto(streamlit_url)
            # The box states the API's limit (DMLSEARCH_MAX_UPLOAD_BYTES above), not Streamlit's own 200MB.
            instructions = view.get_by_test_id("stFileUploaderDropzoneInstructions")
            instructions.wait_for(timeout=60_000)
            assert "5MB per file" in instructions.inner_text()
            view.locator('input[type="file"]').set_input_files(str(query))
            view.get_by_text("#1 · score 1.000").wait_for(timeout=90_000)
            scores = view.get_by_text(re.compile(r"^#\d+ · score \d\.\d{3}$"))
            scores.nth(11).wait_for(timeout=30_000)
            assert scores.count() == 12  # the default K
            view.get_by_text("Predicted label:").wait_for(timeout=10_000)
            images = view.locator('[data-testid="stImage"] img')
            view.wait_for_function(
                "() => [...document.querySelectorAll('[data-testid=stImage] img')]"
                ".filter(img => img.complete && img.naturalWidth > 0).length >= 13",
                timeout=30_000,
            )
            assert images.count() == 13  # 12 result thumbnails and the query
            view.screenshot(path=str(screenshot), full_page=True)
            view.get_by_text("Why it matched").nth(1).click()  # the second result's heatmaps
            view.get_by_text(re.compile(r"^why: result$")).wait_for(timeout=60_000)
            view.get_by_text(
                re.compile(r"The outlined regions, one in each image, carry .*% of the match")
            ).wait_for(timeout=10_000)
            view.wait_for_function(
                "() => [...document.querySelectorAll('[data-testid=stImage] img')]"
                ".filter(img => img.complete && img.naturalWidth > 0).length >= 15",
                timeout=30_000,
            )
            view.screenshot(path=str(tmp_path / "why.png"), full_page=True)
            view.get_by_role("button", name="Similar").nth(1).click()  # search by the second result
            view.get_by_text(re.compile(r"^query: item \d+$")).wait_for(timeout=60_000)
        finally:
            browser.close()
    assert screenshot.stat().st_size > 10_000
    if SCREENSHOT_COPY:
        shutil.copy(screenshot, SCREENSHOT_COPY)


@pytest.mark.browser
def test_real_browser_thumbs_up_and_down_then_refine(
    sync_api: ModuleType, streamlit_url: str, demo_gallery: Path, tmp_path: Path
) -> None:
    def result_paths(view) -> list[str]:
        captions = view.locator('[data-testid="stCaptionContainer"]').all_inner_texts()
        return [match.group(1) for caption in captions if (match := RESULT_CAPTION.search(caption))]

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            view = browser.new_page(viewport={"width": 1400, "height": 1900})
            view.goto(streamlit_url)
            view.locator('input[type="file"]').set_input_files(str(demo_gallery / "cat/00_crop.jpg"))
            view.get_by_text("#1 · score 1.000").wait_for(timeout=90_000)
            view.get_by_text(re.compile(r"^#12 · score")).wait_for(timeout=30_000)
            plain = result_paths(view)
            assert len(plain) == 12
            view.get_by_role("button", name="👍", exact=True).nth(1).click()  # the second result
            view.get_by_text(re.compile(r"Your judgments: 👍 1 · 👎 0")).wait_for(timeout=60_000)
            view.get_by_role("button", name="👎", exact=True).nth(2).click()  # the third
            view.get_by_text(re.compile(r"Your judgments: 👍 1 · 👎 1")).wait_for(timeout=60_000)
            assert result_paths(view) == plain  # judged, not refined yet
            view.get_by_role("button", name="Refine", exact=True).click()
            view.get_by_text(re.compile(r"^Results refined by 2 judgment\(s\)")).wait_for(timeout=60_000)
            view.get_by_text(re.compile(r"^#12 · score")).wait_for(timeout=30_000)
            refined = result_paths(view)
            assert len(refined) == 12 and plain[1] not in refined and plain[2] not in refined
            assert refined != plain
            # The query and its judgments stay on the page.
            for caption in ("query", re.compile(r"^👍 item \d+$"), re.compile(r"^👎 item \d+$")):
                view.get_by_text(caption).first.wait_for(timeout=10_000)
            view.screenshot(path=str(tmp_path / "refined.png"), full_page=True)
        finally:
            browser.close()


@pytest.mark.browser
def test_real_browser_box_drawn_on_the_query_searches_by_the_region(
    sync_api: ModuleType, streamlit_url: str, demo_gallery: Path, tmp_path: Path
) -> None:
    """The cropper's box starts at 20-80% of the preview; the cat sits 150, 67 scene pixels right and down
    of it, so it is found first only once the box is dragged onto it."""
    from PIL import Image

    from bench.lib.images import make_image

    scene = make_image(8, (1000, 667))
    scene.paste(Image.open(demo_gallery / "cat/00_crop.jpg").convert("RGB").resize((600, 400)), (350, 200))
    scene.save(tmp_path / "scene.png")
    first_result = re.compile(r"^#1 · score (\d\.\d{3})$")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            view = browser.new_page(viewport={"width": 1400, "height": 1900})
            view.goto(streamlit_url)
            view.get_by_test_id("stFileUploaderDropzoneInstructions").wait_for(timeout=60_000)
            view.locator('input[type="file"]').set_input_files(str(tmp_path / "scene.png"))
            view.get_by_text(first_result).wait_for(timeout=90_000)
            assert top_path(view) != "cat/00_crop.jpg"  # the scene as a whole is not the cat
            view.get_by_text("Search by a region").click()
            canvas = view.frame_locator("iframe").first.locator("canvas").first
            canvas.wait_for(timeout=60_000)
            box = canvas.bounding_box()
            scale = box["width"] / 480  # the preview is 480x320; the default box 96,64 to 384,256 on it
            start = (box["x"] + 240 * scale, box["y"] + 160 * scale)
            view.mouse.move(*start)
            view.mouse.down()
            view.mouse.move(start[0] + 72 * scale, start[1] + 32 * scale, steps=12)
            view.mouse.up()
            # The cropper reports the box while it moves (each a rerun): wait for the run of where it ended.
            deadline, found = time.monotonic() + 120, (None, 0.0)
            while found[0] != "cat/00_crop.jpg" or found[1] < 0.9:
                assert time.monotonic() < deadline, f"the cat never came first with the box on it: {found}"
                time.sleep(0.5)
                top = view.get_by_text(first_result).all_inner_texts()
                found = (top_path(view), float(first_result.match(top[0]).group(1)) if top else 0.0)
        finally:
            view.screenshot(path=str(tmp_path / "box.png"), full_page=True)  # kept by pytest's tmp_path
            browser.close()


def top_path(view: object) -> str | None:
    """The path under the first result of the grid (its captions read "label · path")."""
    captions = view.locator('[data-testid="stCaptionContainer"]').all_inner_texts()
    paths = [found.group(1) for found in map(RESULT_CAPTION.search, captions) if found]
    return paths[0] if paths else None


def test_duplicates_page_by_tier_shows_evidence_and_keep_ticks(page) -> None:
    page.sidebar.radio(key="page").set_value("Duplicates")
    page.run()
    page.radio(key="dup_tier").set_value("edited")
    page.run()
    assert not page.exception
    groups = [text for text in texts(page.markdown) if text.startswith("**Group ")]
    assert groups and all(" · edited · " in g or " · exact · " in g for g in groups)
    evidence = [caption for caption in texts(page.caption) if " · cosine " in caption]
    assert len(evidence) == len(page.image) >= 2 * len(groups)
    ticks = [box for box in page.checkbox if box.key.startswith("dup_keep_edited_")]
    assert len(ticks) == len(evidence) and sum(box.value for box in ticks) == len(groups)  # one keeper each


@pytest.fixture
@starts("server")
def writable_ui(
    tmp_path: Path, demo_gallery: Path, demo_index: Path, exported_model: Path
) -> Iterator[tuple]:
    """A served copy of the demo index with an API key, and ``dmlsearch ui`` talking to it."""
    from tests.support.served import copy_served

    served = copy_served(demo_gallery, demo_index, exported_model, tmp_path)
    args = [
        "--index",
        str(served.index),
        "--model",
        str(served.model),
        "--rate-limit",
        "0",
        "--api-key",
        "k3y",
    ]
    with uvicorn_server(args) as url:
        port = free_port()
        command = [sys.executable, "-m", "cli.main", "ui", "--api-url", url, "--port", str(port)]
        process = subprocess.Popen(command)
        ui_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, "streamlit exited"
                try:
                    if httpx.get(f"{ui_url}/_stcore/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "streamlit did not start"
                time.sleep(0.3)
            yield served, url, ui_url
        finally:
            process.terminate()
            process.wait(timeout=20)


@pytest.mark.browser
def test_real_browser_applies_duplicate_decisions(sync_api: ModuleType, writable_ui: tuple) -> None:
    served, api, ui_url = writable_ui
    first = httpx.get(f"{api}/v1/duplicates", params={"tier": "edited", "limit": 1}, timeout=60).json()
    # The same photo saved twice: a byte copy of the group's keeper joins the group, to be set aside.
    keeper_path = next(i["path"] for i in first["groups"][0]["items"] if i["review"]["action"] == "keep")
    backup = Path(keeper_path).with_name("backup " + Path(keeper_path).name).as_posix()
    shutil.copyfile(served.gallery / keeper_path, served.gallery / backup)
    again = httpx.get(f"{api}/v1/duplicates", params={"tier": "edited", "limit": 1}, timeout=60).json()
    group = again["groups"][0]
    assert next(i for i in group["items"] if i["path"] == backup)["byte_copy"]
    aside = [item for item in group["items"] if item["review"]["action"] == "set_aside"]
    keeper = next(item for item in group["items"] if item["review"]["action"] == "keep")
    changed_mind = aside[0]  # the person ticks it to keep it after all
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            view = browser.new_page(viewport={"width": 1400, "height": 1900})
            view.goto(ui_url)
            view.get_by_text("Duplicates", exact=True).first.click()
            view.get_by_text("edited", exact=True).first.click()
            view.get_by_text(re.compile(r"^Group 1 · \w+ · \d+ images$")).first.wait_for(timeout=90_000)
            ticks = view.get_by_role("checkbox", name="keep")
            ticks.first.wait_for(timeout=30_000)
            view.get_by_text(re.compile(r"byte copy \(indexed once\)")).first.wait_for(timeout=30_000)
            assert ticks.nth(group["items"].index(keeper)).is_checked()
            box = ticks.nth(group["items"].index(changed_mind))
            assert not box.is_checked()
            box.check(force=True)
            view.wait_for_function(
                "(n) => document.querySelectorAll('input[type=checkbox]')[n].checked",
                arg=group["items"].index(changed_mind),
                timeout=30_000,
            )
            view.get_by_label("API key", exact=True).fill("k3y")  # the page's own, not the sidebar's
            view.get_by_label("API key", exact=True).press("Enter")
            time.sleep(1)  # the rerun with the key
            # Each group says why its keeper is kept.
            view.get_by_text(f"Keep {keeper['path']}: {group['reason']}").wait_for(timeout=30_000)
            view.get_by_role("button", name="Apply: set aside the unticked images").click()
            view.get_by_text(re.compile(r"^Set aside \d+ images into ")).wait_for(timeout=90_000)
            set_aside = {item["path"] for item in aside} - {changed_mind["path"]}
            trash = next((served.gallery / ".dmlsearch-trash").iterdir())
            for path in set_aside:  # other groups of the page may have been set aside too: these at least
                assert (trash / path).is_file() and not (served.gallery / path).exists()
            assert (served.gallery / changed_mind["path"]).is_file()
            assert (served.gallery / keeper["path"]).is_file()
            assert httpx.get(f"{api}/v1/items/{changed_mind['id']}", timeout=30).status_code == 200
            for item in aside[1:]:
                expected = 200 if item["byte_copy"] else 404  # a byte copy's item is the keeper's
                assert httpx.get(f"{api}/v1/items/{item['id']}", timeout=30).status_code == expected
            # The page shows the groups as they are now: the images set aside are gone from it.
            view.get_by_text(re.compile(r"^Group 1 · \w+ · \d+ images$")).first.wait_for(timeout=90_000)
            shown = " ".join(view.locator('[data-testid="stCaptionContainer"]').all_inner_texts())
            assert not any(f" · {path}" in shown for path in set_aside), shown
            view.get_by_role("button", name="Undo").click()
            view.get_by_text(re.compile(r"^Put back \d+ images and their \d+ items")).wait_for(timeout=90_000)
            for item in aside:  # back, under the ids they had
                assert (served.gallery / item["path"]).is_file()
                found = httpx.get(f"{api}/v1/items/{item['id']}", timeout=30)
                assert found.status_code == 200
                assert item["byte_copy"] or found.json()["path"] == item["path"]
            assert not (served.gallery / ".dmlsearch-trash").exists()  # the undo leaves no trace
            view.get_by_text(re.compile(r"^Group 1 · \w+ · \d+ images$")).first.wait_for(timeout=90_000)
            view.wait_for_function(
                "(paths) => paths.every(p => [...document.querySelectorAll("
                "'[data-testid=stCaptionContainer]')].some(c => c.innerText.includes(' · ' + p)))",
                arg=sorted(set_aside),
                timeout=60_000,
            )
            # The similar tier proposes to set aside no image of a similar group (its groups of stricter
            # tiers keep one image each), and says why.
            similar = httpx.get(f"{api}/v1/duplicates", params={"tier": "similar", "limit": 10}, timeout=60)
            groups = similar.json()["groups"]
            kept = sum(len(g["items"]) if g["tier"] == "similar" else 1 for g in groups)
            view.get_by_text("similar", exact=True).first.click()
            view.get_by_text("Similar is not duplicate", exact=False).first.wait_for(timeout=90_000)
            view.wait_for_function(
                "([n, all]) => { const boxes = [...document.querySelectorAll('input[type=checkbox]')];"
                " return boxes.length == all && boxes.filter(b => b.checked).length == n; }",
                arg=[kept, sum(len(g["items"]) for g in groups)],
                timeout=60_000,
            )
        finally:
            browser.close()
