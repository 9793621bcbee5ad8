"""GET /v1/duplicates over the demo index (each photo has crop, mirror, colour and scale variants)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from index.duplicates import DEFAULT_MAX_DISTANCE, DEFAULT_THRESHOLD


def test_groups_are_paged_largest_first_with_scores(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    everything = client.get("/v1/duplicates", params={"limit": 100}).json()
    assert everything["threshold"] == DEFAULT_THRESHOLD and everything["offset"] == 0
    assert everything["max_distance"] == DEFAULT_MAX_DISTANCE
    assert everything["unsigned"] == 0 and everything["note"] is None  # built with signatures
    assert everything["criteria"] == (
        f"cosine >= {DEFAULT_THRESHOLD} with perceptual signatures within {DEFAULT_MAX_DISTANCE} bits"
    )
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
    assert stricter["threshold"] == 0.999 and stricter["total"] < len(groups)
    exact = client.get("/v1/duplicates", params={"max_distance": 0, "limit": 100}).json()
    wider = [{item["id"] for item in group["items"]} for group in groups]
    assert exact["max_distance"] == 0  # fewer bits only split groups, never join them
    assert all(any({item["id"] for item in g["items"]} <= w for w in wider) for g in exact["groups"])
    pages = [
        client.get("/v1/duplicates", params={"max_distance": 0, "offset": o, "limit": 1}).json()
        for o in range(exact["total"] + 1)
    ]
    assert [group for page in pages for group in page["groups"]] == exact["groups"]  # pages of one setting
    assert pages[-1]["groups"] == [] and pages[-1]["total"] == exact["total"]


def test_bad_parameters_are_422(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    for params in (
        {"threshold": 1.5},
        {"limit": 0},
        {"limit": 101},
        {"offset": -1},
        {"threshold": "x"},
        {"max_distance": -1},
        {"max_distance": 17},
    ):
        response = client.get("/v1/duplicates", params=params)
        assert response.status_code == 422, params
        assert response.json()["error"]["code"] == "invalid_request"
