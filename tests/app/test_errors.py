"""app/errors.py: every DmlsearchError answers the status of its kind with its code and message; anything
else is a 500 whose id is in the log next to the traceback."""

from __future__ import annotations

import logging
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.errors import KIND_STATUS, ApiError, install_error_handlers
from engine.decode.images import ImageDecodeError
from engine.decode.pool import DecodeCancelledError, DecodePoolClosedError
from engine.serve.item_reader import ItemNotFoundError
from engine.serve.item_writer import DuplicateItemError, InvalidItemError, StorageError
from engine.serve.query import RerankUnavailableError
from foundation.errors import DmlsearchError, ErrorKind, NotFoundError
from index.filters import UnknownLabelError
from index.protocol import BackendUnavailableError

# (error raised, status, code, headers it must carry): the answers the API gave before the taxonomy.
CASES = [
    (
        ImageDecodeError("unsupported_format", "image format ICO is not supported"),
        415,
        "unsupported_format",
        {},
    ),
    (ImageDecodeError("image_too_large", "over the pixel limit"), 413, "image_too_large", {}),
    (ImageDecodeError("batch_too_large", "too many pixels in all"), 413, "batch_too_large", {}),
    (ImageDecodeError("image_too_costly", "decode over its time limit"), 422, "image_too_costly", {}),
    (ImageDecodeError("corrupt_image", "could not be decoded"), 400, "corrupt_image", {}),
    (ImageDecodeError("empty_image", "the file is empty"), 400, "empty_image", {}),
    (ItemNotFoundError("no item with id 7"), 404, "item_not_found", {}),
    (RerankUnavailableError("this model has no PDDM unit"), 422, "rerank_unavailable", {}),
    (UnknownLabelError("no item has the label 'x'"), 404, "unknown_label", {}),
    (InvalidItemError("bad label"), 422, "invalid_item", {}),
    (DuplicateItemError("already indexed as item 3"), 409, "duplicate_item", {}),
    (DecodeCancelledError("the client went away"), 499, "client_closed_request", {}),
    (DecodePoolClosedError("the server is stopping"), 503, "shutting_down", {"connection": "close"}),
    (StorageError("nothing was written: read-only"), 503, "storage_unavailable", {}),
    (BackendUnavailableError("Milvus at http://x: refused"), 503, "index_unavailable", {"retry-after": "5"}),
    (ApiError(ErrorKind.UNAUTHORIZED, "missing_api_key", "send the key"), 401, "missing_api_key", {}),
    (ApiError(ErrorKind.FORBIDDEN, "writes_disabled", "no writes"), 403, "writes_disabled", {}),
    (NotFoundError("model file m.onnx does not exist"), 404, "not_found", {}),
]


def _client_raising(error: BaseException) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/fail")
    async def fail() -> None:
        raise error

    return TestClient(app, raise_server_exceptions=False)


def test_every_kind_has_a_status() -> None:
    assert set(KIND_STATUS) == set(ErrorKind)


@pytest.mark.parametrize(("error", "status", "code", "headers"), CASES, ids=[case[2] for case in CASES])
def test_a_domain_error_answers_its_kinds_status_code_and_message(
    error: DmlsearchError, status: int, code: str, headers: dict[str, str]
) -> None:
    response = _client_raising(error).get("/fail")
    assert response.status_code == status
    assert response.json() == {"error": {"code": code, "message": str(error)}}
    assert {name: response.headers.get(name) for name in headers} == headers


@pytest.mark.parametrize("error", [ValueError("a bug"), KeyError("a bug"), RuntimeError("a bug")])
def test_an_unexpected_error_is_a_500_logged_with_its_traceback_and_id(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="dmlsearch.app"):
        response = _client_raising(error).get("/fail")
    assert response.status_code == 500
    body = response.json()["error"]
    assert body["code"] == "internal_error" and "a bug" not in body["message"]  # no internals leak
    match = re.fullmatch(r"internal server error \(error id ([0-9a-f]{12})\)", body["message"])
    assert match is not None
    (record,) = [r for r in caplog.records if r.name == "dmlsearch.app"]
    assert match.group(1) in record.getMessage() and record.exc_info is not None
    assert record.exc_info[1] is error


def test_server_side_failures_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="dmlsearch.app"):
        _client_raising(StorageError("disk full")).get("/fail")
        _client_raising(InvalidItemError("bad label")).get("/fail")  # the client's fault: not logged
    assert [r.getMessage() for r in caplog.records if r.name == "dmlsearch.app"] == [
        "write refused on GET /fail: disk full"
    ]
