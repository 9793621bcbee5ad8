"""GET /v1/duplicates over the demo index (each photo has crop, mirror, colour and scale variants)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from engine.duplicates.groups import DEFAULT_MAX_DISTANCE, DEFAULT_THRESHOLD
from foundation.defaults import KEEPER_RULE
from tests.support.served import Served


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


def test_tiers_give_evidence_and_a_keeper_proposal(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    for tier in ("exact", "edited", "similar"):
        page = client.get("/v1/duplicates", params={"tier": tier, "limit": 100}).json()
        assert page["tier"] == tier and page["keeper_rule"] == list(KEEPER_RULE)
        rank = ["exact", "edited", "similar"].index(tier)
        for group in page["groups"]:
            assert ["exact", "edited", "similar"].index(group["tier"]) <= rank
            actions = [item["review"]["action"] for item in group["items"]]
            assert len(actions) == group["size"] >= 2
            if group["tier"] == "similar":  # no duplicate: nothing is proposed to be set aside
                assert set(actions) == {"keep"} and "similar, not duplicate" in group["reason"]
                continue
            assert actions.count("keep") == 1 and group["reason"]
            kept = next(item for item in group["items"] if item["review"]["action"] == "keep")
            assert kept["review"]["pixels"] == max(item["review"]["pixels"] for item in group["items"])
            # The demo's variants are written with their photo, in one go: their times tell nothing.
            assert "earliest capture time" not in group["reason"]
            for item in group["items"]:
                evidence = item["evidence"]
                assert evidence["pairs_with"] in {other["id"] for other in group["items"]} - {item["id"]}
                assert evidence["signature_bits"] is not None and -1.0 <= evidence["cosine"] <= 1.0
                assert evidence["alignment"] is None or -1.0 <= evidence["alignment"] <= 1.0
    edited = client.get("/v1/duplicates", params={"tier": "edited", "limit": 100}).json()
    paths = [{item["path"] for item in group["items"]} for group in edited["groups"]]
    assert any({"cat/00_original.jpg", "cat/00_small.jpg"} <= group for group in paths)
    assert client.get("/v1/duplicates", params={"tier": "nearly"}).status_code == 422


def _plan(group: dict, plan_id: str = "test-plan") -> dict:
    members = [
        {
            "id": i["id"],
            "path": i["path"],
            "content_hash": i["review"]["content_hash"],
            "action": i["review"]["action"],
        }
        for i in group["items"]
    ]
    return {"version": 1, "plan_id": plan_id, "groups": [{"members": members}]}


def test_a_plan_is_applied_with_the_api_key_and_nothing_is_deleted(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client(api_key="secret")
    group = client.get("/v1/duplicates", params={"tier": "edited", "limit": 1}).json()["groups"][0]
    plan = _plan(group)
    aside = [m["path"] for m in plan["groups"][0]["members"] if m["action"] == "set_aside"]
    assert client.post("/v1/duplicates/apply", json=plan).status_code == 401
    wrong = client.post("/v1/duplicates/apply", json=plan, headers={"X-API-Key": "nope"})
    assert wrong.status_code in (401, 403)
    keepless = _plan(group)
    for member in keepless["groups"][0]["members"]:
        member["action"] = "set_aside"
    refused = client.post("/v1/duplicates/apply", json=keepless, headers={"X-API-Key": "secret"})
    assert refused.status_code == 422 and "keeps no image" in refused.json()["error"]["message"]
    outside = _plan(group)
    outside["groups"][0]["members"][-1] |= {"path": "../../etc/passwd", "action": "set_aside"}
    outside["groups"][0]["members"][0]["action"] = "keep"
    assert (
        client.post("/v1/duplicates/apply", json=outside, headers={"X-API-Key": "secret"}).status_code == 422
    )
    assert all((served.gallery / path).exists() for path in aside)  # nothing moved by a refused plan

    applied = client.post("/v1/duplicates/apply", json=plan, headers={"X-API-Key": "secret"})
    assert applied.status_code == 200, applied.text
    body = applied.json()
    assert sorted(body["moved"]) == sorted(aside) and body["removed"] == len(aside)
    trash = served.gallery / body["trash"]
    for path in aside:
        assert not (served.gallery / path).exists() and (trash / path).is_file()
    ids = {m["id"] for m in plan["groups"][0]["members"] if m["action"] == "set_aside"}
    for item_id in ids:
        assert client.get(f"/v1/items/{item_id}").status_code == 404
    again = client.post("/v1/duplicates/apply", json=plan, headers={"X-API-Key": "secret"}).json()
    assert again["moved"] == [] and sorted(again["already"]) == sorted(aside) and again["removed"] == 0


def test_a_byte_copy_is_an_exact_member_and_a_kept_copy_takes_its_item_over(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    """A file with an indexed image's bytes is no item (indexed once); the review shows it under its item's
    id, and keeping it while setting the item's file aside hands it the item."""
    original, backup = "cat/00_original.jpg", "cat/00_backup.jpg"
    client = make_client(api_key="secret")
    before = client.get("/v1/duplicates", params={"tier": "exact", "limit": 100}).json()  # groups cached
    assert all(not item["byte_copy"] for group in before["groups"] for item in group["items"])
    shutil.copyfile(served.gallery / original, served.gallery / backup)  # the index does not change
    page = client.get("/v1/duplicates", params={"tier": "exact", "limit": 100}).json()
    group = next(g for g in page["groups"] if backup in {i["path"] for i in g["items"]})
    members = {i["path"]: i for i in group["items"]}
    copy, item = members[backup], members[original]
    assert copy["byte_copy"] and not item["byte_copy"] and copy["id"] == item["id"]
    assert group["tier"] == "exact"
    assert copy["evidence"]["hash"] == f"sha256:{item['review']['content_hash']}"
    assert copy["review"]["action"] == "set_aside"  # the index names the item: it is the one kept

    plan = _plan(group)
    for member in plan["groups"][0]["members"]:
        member["action"] = "set_aside" if member["path"] == original else "keep"
    applied = client.post("/v1/duplicates/apply", json=plan, headers={"X-API-Key": "secret"})
    assert applied.status_code == 200, applied.text
    body = applied.json()
    assert body["moved"] == [original] and body["removed"] == 0 and body["handed"] == 1
    assert client.get(f"/v1/items/{item['id']}").json()["path"] == backup
    assert (served.gallery / body["trash"] / original).is_file() and (served.gallery / backup).is_file()


def test_an_apply_is_undone_by_its_plan_id_and_its_items_keep_their_ids(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client(api_key="secret")
    key = {"X-API-Key": "secret"}
    count = client.get("/v1/stats").json()["count"]
    group = client.get("/v1/duplicates", params={"tier": "edited", "limit": 1}).json()["groups"][0]
    plan = _plan(group, "undo-me")
    aside = {m["id"]: m["path"] for m in plan["groups"][0]["members"] if m["action"] == "set_aside"}
    applied = client.post("/v1/duplicates/apply", json=plan, headers=key).json()
    assert applied["plan_id"] == "undo-me" and applied["count"] == count - len(aside)
    assert (
        served.gallery / applied["trash"] / ".dmlsearch-plan.json"
    ).is_file()  # the undo needs nothing else

    assert client.post("/v1/duplicates/undo", json={"plan_id": "undo-me"}).status_code == 401
    undone = client.post("/v1/duplicates/undo", json={"plan_id": "undo-me"}, headers=key)
    assert undone.status_code == 200, undone.text
    body = undone.json()
    assert sorted(body["moved"]) == sorted(aside.values()) and body["restored"] == len(aside)
    assert body["reindexed"] == 0 and body["count"] == count
    for item_id, path in aside.items():  # the same ids, not new items
        assert client.get(f"/v1/items/{item_id}").json()["path"] == path
        assert (served.gallery / path).is_file()
    page = client.get("/v1/duplicates", params={"tier": "edited", "limit": 1}).json()["groups"][0]
    assert {i["path"] for i in page["items"]} == {
        i["path"] for i in group["items"]
    }  # the group is whole again
    # The undo left no trace: no trash folder, so nothing to undo again.
    assert (
        not (served.gallery / applied["trash"]).exists()
        and not (served.gallery / applied["trash"]).parent.exists()
    )
    again = client.post("/v1/duplicates/undo", json={"plan_id": "undo-me"}, headers=key)
    assert again.status_code == 404 and again.json()["error"]["code"] == "plan_not_found"
    assert client.get("/v1/stats").json()["count"] == count
    missing = client.post("/v1/duplicates/undo", json={"plan_id": "never-applied"}, headers=key)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "plan_not_found"


def test_a_plan_that_is_not_json_gets_a_clear_422(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_key="secret")
    broken = client.post(
        "/v1/duplicates/apply",
        content=b'{"version": 1, "plan_id": }',
        headers={"X-API-Key": "secret", "Content-Type": "application/json"},
    )
    assert broken.status_code == 422
    error = broken.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(
        "the request body is not valid JSON: Expecting value (at character 26)"
    )


@pytest.mark.parametrize(
    "path",
    [
        ".",
        "./",
        "./.",
        "a/.",
        "./a",
        ".//.dmlsearch-trash/x",
        "./.dmlsearch-trash",
        ".dmlsearch-trash2/x",
        "a/../b",
        "..",
        "a/b..c",
        ".hidden/x",
        "a//b",
        "a\nb",
        "x/.dmlsearch-trash/y",
        "/etc/passwd",
        "a\x00b",
    ],
)
def test_the_plan_path_pattern_is_the_rule_apply_enforces(path: str) -> None:
    """The schema's pattern (as the contract's validator, Rust's regex, reads it), the API's check and
    the apply's own check agree on which paths a plan may set aside."""
    import re

    from app.schemas import PLAN_PATH_PATTERN
    from engine.duplicates.review import _inside

    schema_says = jsonschema_rs.validator_for({"type": "string", "pattern": PLAN_PATH_PATTERN}).is_valid(path)
    assert schema_says == bool(re.match(PLAN_PATH_PATTERN, path)) == (_inside(path) and "\x00" not in path)
