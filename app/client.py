"""A small client of the dmlsearch HTTP API (what the Streamlit page uses; usable from scripts too)."""

from __future__ import annotations

from typing import Any

import httpx

from foundation import defaults


class ApiCallError(Exception):
    """The API answered with an error, or could not be reached; ``str()`` is a message for people."""


class SearchClient:
    def __init__(self, base_url: str, *, timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ApiCallError(f"could not reach the API at {self.base_url}: {err}") from None
        if response.status_code >= 400:
            raise ApiCallError(_error_message(response))
        return response

    def stats(self) -> dict:
        return self._call("GET", "/v1/stats").json()

    def items(self, offset: int = 0, limit: int = 1000) -> dict:
        return self._call("GET", "/v1/items", params={"offset": offset, "limit": limit}).json()

    def labels(self) -> list[str]:
        return [entry["label"] for entry in self._call("GET", "/v1/labels").json()["labels"]]

    def search(self, name: str, data: bytes, **params: Any) -> dict:
        return self._call("POST", "/v1/search", params=params, files={"image": (name, data)}).json()

    def similar(self, item_id: int, **params: Any) -> dict:
        return self._call("GET", f"/v1/items/{item_id}/similar", params=params).json()

    def explain(
        self,
        item_id: int,
        *,
        query_item: int | None = None,
        upload: tuple[str, bytes] | None = None,
        box: str | None = None,
    ) -> dict:
        """Why ``item_id`` matched: the query is another item (``query_item``) or an upload (name, bytes),
        or a ``box`` of either (as ``search``'s)."""
        params: dict[str, Any] = {"item": item_id} | ({"box": box} if box else {})
        if upload is not None:
            return self._call("POST", "/v1/explain", params=params, files={"image": upload}).json()
        return self._call("GET", "/v1/explain", params=params | {"query_item": query_item}).json()

    def add_feedback(self, query: dict, result: int, sign: int, api_key: str) -> dict:
        """Keep one judgment (``POST /v1/feedback``, with the API key): ``query`` is ``{"query_item": id}``
        or ``{"query_image": BASE64}``; ``sign`` 1 (👍) or -1 (👎). Returns the judgment kept (its ``id``)."""
        body = {**query, "result": result, "sign": sign}
        return self._call("POST", "/v1/feedback", json=body, headers={"X-API-Key": api_key}).json()

    def delete_feedback(self, judgment_id: int, api_key: str) -> dict:
        """Take a kept judgment back (``DELETE /v1/feedback/{id}``, with the API key)."""
        return self._call("DELETE", f"/v1/feedback/{judgment_id}", headers={"X-API-Key": api_key}).json()

    def duplicates(
        self, threshold: float | None = None, offset: int = 0, limit: int = 20, tier: str | None = None
    ) -> dict:
        """``threshold`` None: the index's default; ``tier``: exact, edited or similar (or None)."""
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if threshold is not None:
            params["threshold"] = threshold
        if tier is not None:
            params["tier"] = tier
        return self._call("GET", "/v1/duplicates", params=params).json()

    def apply_plan(self, plan: dict, api_key: str) -> dict:
        """Apply a duplicates plan (``POST /v1/duplicates/apply``, with the API key)."""
        return self._call("POST", "/v1/duplicates/apply", json=plan, headers={"X-API-Key": api_key}).json()

    def undo_plan(self, plan_id: str, api_key: str) -> dict:
        """Undo an applied plan (``POST /v1/duplicates/undo``, with the API key)."""
        body = {"plan_id": plan_id}
        return self._call("POST", "/v1/duplicates/undo", json=body, headers={"X-API-Key": api_key}).json()

    def model(self) -> dict:
        return self._call("GET", "/v1/model").json()

    def plot(self, url: str) -> bytes:
        """A plot of the model's report, by the ``url`` that :meth:`model` lists."""
        return self._call("GET", url).content

    def thumbnail(self, item_id: int, size: int = defaults.THUMBNAIL_SIZE) -> bytes:
        return self._call("GET", f"/v1/items/{item_id}/thumbnail", params={"size": size}).content


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"
