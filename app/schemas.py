"""Response bodies of the HTTP API (the OpenAPI contract)."""

from __future__ import annotations

from pydantic import BaseModel


class ResultOut(BaseModel):
    id: int
    path: str
    label: str | None
    score: float
    rank: int


class SearchOut(BaseModel):
    results: list[ResultOut]
    took_ms: float
    model_fingerprint: str


class StatsOut(BaseModel):
    count: int
    dim: int
    backend: str
    index_type: str
    metric: str
    model_fingerprint: str
    achieved_recall: float | None


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorOut(BaseModel):
    error: ErrorBody
