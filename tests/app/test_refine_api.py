"""A search refined by examples through the API: ids and uploaded images, both strategies, each refusal."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from engine.serve.query import ItemQuery, SearchOptions
from engine.serve.refine import Refinement, Strategy
from engine.serve.search import SearchService
from foundation import defaults
from tests.support.served import Served

CAT = "cat/00_crop.jpg"
COFFEE = "coffee/01_crop.jpg"


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture
def engine(served: Served) -> Iterator[SearchService]:
    """The engine over the same index, to hold the API's answers to."""
    service = SearchService.open(served.model, served.index, threads=1)
    yield service
    service.close()


def _ids(client: TestClient, label: str) -> list[int]:
    return [item["id"] for item in client.get("/v1/items").json()["items"] if item["label"] == label]


def _engine_ids(engine: SearchService, query: bytes | ItemQuery, refine: Refinement, k: int) -> list[int]:
    found = engine.queries.search([query], SearchOptions(k=k, refine=refine)).queries[0].results
    return [result.id for result in found]


@pytest.mark.parametrize("strategy", list(Strategy))
def test_similar_refined_by_ids_is_the_engines_answer_without_the_examples(
    client: TestClient, engine: SearchService, strategy: Strategy
) -> None:
    cats, coffees = _ids(client, "cat"), _ids(client, "coffee")
    query, liked, disliked = cats[0], coffees[0], cats[1]
    params = {"k": 8, "positive": [liked], "negative": [disliked], "strategy": strategy.value}
    response = client.get(f"/v1/items/{query}/similar", params=params)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    ids = [result["id"] for result in results]
    assert not {query, liked, disliked} & set(ids)
    refine = Refinement((liked,), (disliked,), strategy)
    assert ids == _engine_ids(engine, ItemQuery(query), refine, 8)
    assert [r["rank"] for r in results] == list(range(1, 9))
    # Liking a coffee photo for a cat query brings coffee photos up.
    plain = client.get(f"/v1/items/{query}/similar", params={"k": 8}).json()["results"]
    assert sum(r["label"] == "coffee" for r in results) > sum(r["label"] == "coffee" for r in plain)


def test_search_takes_uploaded_examples_as_multipart_and_json(
    client: TestClient, engine: SearchService, served: Served
) -> None:
    query, liked = (served.gallery / CAT).read_bytes(), (served.gallery / COFFEE).read_bytes()
    disliked_id = _ids(client, "cat")[-1]
    params = {"k": 6, "negative": [disliked_id], "strategy": "best_score"}
    files = [("image", ("q.jpg", query)), ("positive_images", ("p.jpg", liked))]
    multipart = client.post("/v1/search", params=params, files=files)
    body = {"image": base64.b64encode(query).decode(), "positive_images": [base64.b64encode(liked).decode()]}
    as_json = client.post("/v1/search", params=params, json=body)
    assert multipart.status_code == as_json.status_code == 200, multipart.text
    ids = [result["id"] for result in multipart.json()["results"]]
    assert ids == [result["id"] for result in as_json.json()["results"]]
    refine = Refinement((liked,), (disliked_id,), Strategy.BEST_SCORE)
    assert ids == _engine_ids(engine, query, refine, 6)
    assert disliked_id not in ids
    plain = client.post("/v1/search", params={"k": 6}, files={"image": ("q.jpg", query)}).json()["results"]
    assert ids != [result["id"] for result in plain]


def test_batch_refines_every_query_by_the_same_examples(client: TestClient, served: Served) -> None:
    images = [(served.gallery / CAT).read_bytes(), (served.gallery / COFFEE).read_bytes()]
    liked = _ids(client, "coffee")[1]
    response = client.post(
        "/v1/search/batch",
        params={"k": 5, "positive": [liked]},
        files=[("images", (f"{i}.jpg", data)) for i, data in enumerate(images)],
    )
    assert response.status_code == 200, response.text
    for query, data in zip(response.json()["queries"], images, strict=True):
        single = client.post("/v1/search", params={"k": 5, "positive": [liked]}, files={"image": ("q", data)})
        assert [r["id"] for r in query["results"]] == [r["id"] for r in single.json()["results"]]
        assert liked not in [r["id"] for r in query["results"]]


def _refused(response: object, status: int, code: str, words: str) -> None:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    error = response.json()["error"]  # type: ignore[attr-defined]
    assert error["code"] == code and words in error["message"], error


def test_each_bad_refinement_is_a_clear_4xx(client: TestClient, served: Served) -> None:
    cats = _ids(client, "cat")
    similar = f"/v1/items/{cats[0]}/similar"
    unknown = client.get(similar, params={"positive": [999_999]})
    _refused(unknown, 404, "item_not_found", "no item with id 999999")
    _refused(
        client.get(similar, params={"positive": [cats[1]], "negative": [cats[1]]}),
        422,
        "conflicting_examples",
        f"item {cats[1]} is both a positive and a negative example",
    )
    _refused(client.get(similar, params={"negative": [cats[0]]}), 422, "conflicting_examples", "is the query")
    half = defaults.MAX_EXAMPLES // 2 + 1
    _refused(
        client.get(similar, params={"positive": list(range(half)), "negative": list(range(half, 2 * half))}),
        422,
        "too_many_examples",
        f"at most {defaults.MAX_EXAMPLES} positive and negative examples",
    )
    _refused(
        client.get(similar, params={"positive": [cats[1]], "strategy": "sum_scores"}),
        422,
        "invalid_request",
        "'average_vector' or 'best_score'",
    )
    image = {"image": ("q.jpg", (served.gallery / CAT).read_bytes())}
    unknown = client.post("/v1/search", params={"negative": [999_998]}, files=image)
    _refused(unknown, 404, "item_not_found", "999998")
    same = (served.gallery / COFFEE).read_bytes()
    both = [("positive_images", ("a.jpg", same)), ("negative_images", ("b.jpg", same))]
    _refused(
        client.post("/v1/search", files=[*image.items(), *both]),
        422,
        "conflicting_examples",
        "1 uploaded image(s) is both",
    )
    _refused(
        client.post("/v1/search", params={"rerank": "pddm", "positive": [cats[1]]}, files=image),
        422,
        "rerank_unavailable",
        "does not combine",
    )


def test_the_schema_offers_the_examples_on_every_search_route(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    for path, method in (
        ("/v1/search", "post"),
        ("/v1/search/batch", "post"),
        ("/v1/items/{item_id}/similar", "get"),
    ):
        parameters = {p["name"]: p for p in schema["paths"][path][method]["parameters"]}
        assert {"positive", "negative", "strategy"} <= set(parameters), path
        assert parameters["positive"]["schema"]["anyOf"][0]["maxItems"] == defaults.MAX_EXAMPLES
    body = schema["paths"]["/v1/search"]["post"]["requestBody"]["content"]
    assert {"positive_images", "negative_images"} <= set(body["multipart/form-data"]["schema"]["properties"])
    json_body = body["application/json"]["schema"]["properties"]
    assert json_body["positive_images"]["maxItems"] == defaults.MAX_EXAMPLES
