"""Filters (label, path prefix, time taken and added) on search, batch search and similar-by-id, over the
demo index."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cli.main import app
from tests.support.served import Served


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


def test_labels_lists_every_label_with_its_count(client: TestClient) -> None:
    items = client.get("/v1/items", params={"limit": 1000}).json()["items"]
    expected = Counter(item["label"] for item in items if item["label"])
    labels = client.get("/v1/labels").json()["labels"]
    assert [entry["label"] for entry in labels] == sorted(expected)
    assert {entry["label"]: entry["count"] for entry in labels} == expected


def _upload(served: Served, name: str = "cat/00_crop.jpg") -> dict:
    return {"image": ("q.jpg", (served.gallery / name).read_bytes(), "image/jpeg")}


def test_filtered_results_are_the_unfiltered_ranking_restricted_to_the_filter(
    client: TestClient, served: Served
) -> None:
    everything = client.post("/v1/search", params={"k": 100}, files=_upload(served)).json()["results"]
    for params, keep in [
        ({"label": "coffee"}, lambda r: r["label"] == "coffee"),
        ({"label": ["coffee", "rocket"]}, lambda r: r["label"] in ("coffee", "rocket")),
        ({"path_prefix": "motorcycle/"}, lambda r: r["path"].startswith("motorcycle/")),
        ({"path_prefix": "cat/", "label": ["cat", "coffee"]}, lambda r: r["path"].startswith("cat/")),
    ]:
        expected = [(r["id"], round(r["score"], 5)) for r in everything if keep(r)][:5]
        body = client.post("/v1/search", params={"k": 5, **params}, files=_upload(served)).json()
        assert [(r["id"], round(r["score"], 5)) for r in body["results"]] == expected, params
        assert [r["rank"] for r in body["results"]] == list(range(1, len(expected) + 1))


def test_dates_added(client: TestClient, served: Served) -> None:
    added = client.get("/v1/items", params={"limit": 1}).json()["items"][0]["added"]
    past = {"added_to": "2000-01-01"}
    assert client.post("/v1/search", params=past, files=_upload(served)).json()["results"] == []
    since = {"added_from": added, "k": 3}
    assert len(client.post("/v1/search", params=since, files=_upload(served)).json()["results"]) == 3
    # An empty range (what the OpenAPI schema cannot rule out) finds nothing; it was 422.
    for empty in (
        {"added_from": added, "added_to": added},
        {"added_from": "2030-01-01", "added_to": "2020-01-01"},
    ):
        response = client.post("/v1/search", params=empty, files=_upload(served))
        assert response.status_code == 200 and response.json()["results"] == []


def test_batch_and_similar_take_the_same_filters(client: TestClient, served: Served) -> None:
    files = [("images", ("a.jpg", (served.gallery / "cat/00_crop.jpg").read_bytes(), "image/jpeg"))] * 2
    body = client.post("/v1/search/batch", params={"label": "rocket", "k": 4}, files=files).json()
    assert all(r["label"] == "rocket" for query in body["queries"] for r in query["results"])
    assert all(len(query["results"]) == 4 for query in body["queries"])
    item = client.get("/v1/items", params={"limit": 1}).json()["items"][0]
    similar = client.get(f"/v1/items/{item['id']}/similar", params={"path_prefix": "coffee/", "k": 3}).json()
    assert [r["path"][:7] for r in similar["results"]] == ["coffee/"] * 3


def test_dates_taken(client: TestClient, served: Served) -> None:
    """The demo's generated photos have no EXIF: their file times stand in, on this machine's clock."""
    items = client.get("/v1/items", params={"limit": 1000}).json()["items"]
    assert all(item["taken"] and item["taken"][:4] >= "2020" for item in items)
    before = {"taken_to": "2000-01-01"}
    assert client.post("/v1/search", params=before, files=_upload(served)).json()["results"] == []
    since = {"taken_from": min(item["taken"][:19] for item in items), "k": 3}
    assert len(client.post("/v1/search", params=since, files=_upload(served)).json()["results"]) == 3


def test_labels_match_whatever_their_case_and_unknown_ones_are_named(
    client: TestClient, served: Served
) -> None:
    lower = client.post("/v1/search", params={"label": "coffee"}, files=_upload(served)).json()
    upper = client.post("/v1/search", params={"label": "Coffee"}, files=_upload(served)).json()
    assert [r["id"] for r in upper["results"]] == [r["id"] for r in lower["results"]] != []
    response = client.post("/v1/search", params={"label": "cofee"}, files=_upload(served))
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "unknown_label"
    assert "'cofee'" in error["message"] and "cat, coffee" in error["message"]


@pytest.mark.parametrize(
    "params",
    [
        {"taken_from": "2024-06-01T00:00:00+02:00"},
        {"added_from": "yesterday"},
        {"path_prefix": "/etc"},
        {"path_prefix": ""},
    ],
)
def test_bad_filters_are_422(client: TestClient, served: Served, params: dict) -> None:
    response = client.post("/v1/search", params=params, files=_upload(served))
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"


def test_the_query_command_filters_too(served: Served) -> None:
    runner = CliRunner()
    query = str(served.gallery / "cat/00_crop.jpg")
    args = ["query", query, "--index", str(served.index), "--json", "-k", "4"]
    result = runner.invoke(app, [*args, "--label", "coffee", "--label", "temple"])
    assert result.exit_code == 0, result.output
    labels = {r["label"] for r in json.loads(result.output)["results"]}
    assert labels <= {"coffee", "temple"} and len(json.loads(result.output)["results"]) == 4
    result = runner.invoke(app, [*args, "--label", "COFFEE", "--taken-from", "2000-01-01"])
    assert result.exit_code == 0, result.output
    assert {r["label"] for r in json.loads(result.output)["results"]} == {"coffee"}
    result = runner.invoke(app, [*args, "--label", "cofee"])
    assert result.exit_code == 2 and "no item has the label 'cofee'" in result.output
    result = runner.invoke(app, [*args, "--path-prefix", "rocket/"])
    assert all(r["path"].startswith("rocket/") for r in json.loads(result.output)["results"])
    result = runner.invoke(app, [*args, "--added-to", "2000-01-01"])
    assert json.loads(result.output)["results"] == []
    result = runner.invoke(app, ["query", query, "--index", str(served.index), "--added-to", "2000-01-01"])
    assert result.exit_code == 0 and result.output == "no results: no item within the filters\n"
    result = runner.invoke(app, [*args, "--added-from", "2030-01-01", "--added-to", "2020-01-01"])
    assert result.exit_code == 2 and "earlier" in result.output
