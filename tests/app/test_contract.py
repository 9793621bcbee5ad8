"""The API keeps its own OpenAPI contract: schemathesis (``--checks all``) against a real server, with the
write endpoints under a key, finds no failure. Bounded examples keep it to a couple of minutes in CI."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from bench.lib.images import image_bytes, make_image
from tests.support.served import Served
from tests.support.servers import API_KEY, uvicorn_server

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMATHESIS = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
# Examples per operation, and a fixed seed: the same requests on every run.
MAX_EXAMPLES = 25
SEED = 24
REQUEST_SECONDS = 60


@pytest.mark.skipif(SCHEMATHESIS is None, reason="schemathesis is not installed (pip install -e '.[dev]')")
@pytest.mark.server
def test_the_api_keeps_its_openapi_contract(served_module: Served, tmp_path: Path) -> None:
    args = ["--index", str(served_module.index), "--model", str(served_module.model), "--rate-limit", "0"]
    env = {"DMLSEARCH_API_KEY": API_KEY}
    with uvicorn_server(args, env) as url:
        run = subprocess.run(
            [
                str(SCHEMATHESIS),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "all",
                "--header",
                f"X-API-Key: {API_KEY}",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                str(SEED),
                "--generation-deterministic",
                "--request-timeout",
                str(REQUEST_SECONDS),
                # A contract, not a benchmark (speed is measured in bench/): a 64-image batch took 18 s
                # on the loaded 2-core test machine, past schemathesis's default of 10 s.
                "--max-response-time",
                str(REQUEST_SECONDS),
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
            # The hooks module is found from the repository root (tests/ is not an installed package).
            env={
                **os.environ,
                "SCHEMATHESIS_HOOKS": "tests.app.schemathesis_hooks",
                "CONTRACT_INDEX_PATH": str(served_module.index),  # what a positive reload case names
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            },
        )
    (tmp_path / "report.txt").write_text(run.stdout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


# The schema made true where schemathesis found it saying less than the server does (issue 43, class 9).
BOX_ROUTES = [
    ("/v1/search", "post"),
    ("/v1/search/batch", "post"),
    ("/v1/items/{item_id}/similar", "get"),
    ("/v1/explain", "get"),
    ("/v1/explain", "post"),
]


def _box_text(operation: dict) -> jsonschema_rs.Validator:
    """The schema of one box as text (a batch's box parameter is an array of them)."""
    (parameter,) = [p for p in operation["parameters"] if p["name"] == "box"]
    schemas = [parameter["schema"]]
    while "pattern" not in schemas[0]:
        schema = schemas.pop(0)
        schemas += [*schema.get("anyOf", []), *([schema["items"]] if "items" in schema else [])]
    return jsonschema_rs.validator_for(schemas[0])


def test_a_box_without_area_is_refused_by_the_schemas_own_pattern(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client()
    paths = client.get("/openapi.json").json()["paths"]
    data = image_bytes(make_image(1, (200, 200)))
    for path, method in BOX_ROUTES:
        operation = paths[path][method]
        box = _box_text(operation)
        # Before: 0,0,0,0 matched the pattern and got 422 box_inverted, which the schema did not say.
        for empty in ("0,0,0,0", "5,5,0,0", "0,0,0.0,1", "10,10,00,5"):
            assert not box.is_valid(empty), (path, empty)
        for fine in ("0,0,1,1", "0.25,0.2,0.75,0.8", "40,30,200,180", "0,0,0.001,1"):
            assert box.is_valid(fine), (path, fine)
        # What no pattern can tell (inverted, outside the image, too small) is a documented 422.
        for code in ("box_inverted", "box_outside_image", "box_too_small"):
            assert code in operation["responses"]["422"]["description"], (path, method)
    answer = client.post("/v1/search", params={"box": "0,0,0,0"}, files={"image": ("q.png", data)})
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_request"
    assert "right and bottom are above 0" in answer.json()["error"]["message"]
    inverted = client.post("/v1/search", params={"box": "5,5,5,5"}, files={"image": ("q.png", data)})
    assert inverted.status_code == 422 and inverted.json()["error"]["code"] == "box_inverted"


def test_every_upload_documents_its_400s_and_base64_is_the_schemas_own_pattern(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(api_key=API_KEY)
    paths = client.get("/openapi.json").json()["paths"]
    uploads = [
        operation
        for path in paths.values()
        for operation in path.values()
        if "multipart/form-data" in operation.get("requestBody", {}).get("content", {})
    ]
    assert len(uploads) >= 4  # search, batch, explain, add
    for operation in uploads:
        said = operation["responses"]["400"]["description"]
        for code in ("empty_image", "not_an_image", "corrupt_image", "invalid_base64"):
            assert code in said, (operation["operationId"], code)
    add = paths["/v1/items"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    image = jsonschema_rs.validator_for(add["properties"]["images"]["items"])
    real = base64.b64encode(image_bytes(make_image(1))).decode()
    assert image.is_valid(real) and image.is_valid("data:image/png;base64," + real)
    # Before, the schema took each of these, and the server answered 400.
    for text in ("", "é" * 8, "AAA", "AA==AA==", "QUJD\n", "data:image/png;base64,"):
        assert not image.is_valid(text), text
    for text, code in (("é" * 8, "invalid_base64"), ("AAAA", "not_an_image")):
        answer = client.post("/v1/search", json={"image": text})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == code, answer.text


def test_labels_number_at_most_the_batch_and_another_count_is_a_documented_422(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(api_key=API_KEY, max_batch=8)
    body = client.get("/openapi.json").json()["paths"]["/v1/items"]["post"]["requestBody"]["content"]
    for media_type, field in (("multipart/form-data", "label"), ("application/json", "labels")):
        labels = body[media_type]["schema"]["properties"][field]
        arrays = [labels, *labels.get("anyOf", [])]
        assert [schema["maxItems"] for schema in arrays if schema.get("type") == "array"] == [8], media_type
        assert "another count is 422" in labels["description"], media_type
    image = base64.b64encode(image_bytes(make_image(2))).decode()
    answer = client.post(
        "/v1/items", headers={"X-API-Key": API_KEY}, json={"images": [image], "labels": ["a"] * 7}
    )
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_request", answer.text
    assert "7 labels for 1 images" in answer.json()["error"]["message"]
