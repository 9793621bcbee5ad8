"""GET /v1/duplicates over the demo index (each photo has crop, mirror, colour and scale variants)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from index.duplicates import DEFAULT_THRESHOLD


def test_groups_are_paged_largest_first_with_scores(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    everything = client.get("/v1/duplicates", params={"limit": 100}).json()
    assert everything["threshold"] == DEFAULT_THRESHOLD and everything["offset"] == 0
    groups = everything["groups"]
    assert everything["total"] == len(groups) >= 5
    assert [g["size"] for g in groups] == sorted((g["size"] for g in groups), reverse=True)
    for group in groups:
        assert group["size"] == len(group["items"]) >= 2
        assert all(DEFAULT_THRESHOLD <= item["score"] <= 1.0 for item in group["items"])
    members = {item["path"]: group_number for group_number, g in enumerate(groups) for item in g["items"]}
    assert members["cat/00_original.jpg"] == members["cat/00_small.jpg"]  # a photo and its half-size copy

    first = client.get("/v1/duplicates", params={"limit": 2}).json()
    rest = client.get("/v1/duplicates", params={"offset": 2, "limit": 100}).json()
    assert first["groups"] + rest["groups"] == groups
    assert rest["offset"] == 2 and first["total"] == rest["total"] == len(groups)

    stricter = client.get("/v1/duplicates", params={"threshold": 0.999, "limit": 100}).json()
    assert stricter["total"] < len(groups)


def test_bad_parameters_are_422(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    for params in ({"threshold": 1.5}, {"limit": 0}, {"limit": 101}, {"offset": -1}, {"threshold": "x"}):
        response = client.get("/v1/duplicates", params=params)
        assert response.status_code == 422, params
        assert response.json()["error"]["code"] == "invalid_request"
