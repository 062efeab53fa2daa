"""A minimal client of Prometheus's HTTP API (``/api/v1``): what the pictures and tests query.

Usage::

    api = PrometheusAPI("http://127.0.0.1:9090")
    api.query("up")                                   # instant vector: [{"metric": {...}, "value": [t, "1"]}]
    api.query_range("rate(x[5m])", start, end, step=15)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class PrometheusAPI:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, **params: str | float | list[str]) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a successful answer, else ``AssertionError``."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:  # noqa: S310
                body = json.load(response)
        except urllib.error.HTTPError as err:  # Prometheus explains a bad query in the body
            body = json.load(err)
        assert body.get("status") == "success", f"{path} {params}: {body.get('error', body)}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = at
        result = self.api("query", **params)["result"]
        return result if isinstance(result, list) else [result]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]  # type: ignore[no-any-return]

    def exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        return self.api("query_exemplars", query=expr, start=start, end=end)  # type: ignore[no-any-return]

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        params: dict[str, str | float | list[str]] = {"match[]": [match], "start": start, "end": end}
        return self.api("series", **params)  # type: ignore[no-any-return]
