"""A real Prometheus server for tests: started on 127.0.0.1, stopped by PID.

The Debian package's ``prometheus`` runs in the foreground with
``--web.listen-address=127.0.0.1:0``; the port it got is read from its log line
``msg="Listening on" address=127.0.0.1:PORT``, and it is used once it logs
that it is ready. Without the binary, a test fails under ``$CI`` (the test
command installs it) and is skipped elsewhere.

Usage::

    with PrometheusServer(config, tmp_path) as prom:
        prom.query("up")                                # instant vector, as a list of results
        prom.query_range("rate(x[1m])", start, end)     # matrix
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

_LISTENING = re.compile(r'msg="Listening on" address=(127\.0\.0\.1:\d+)')
_READY = "Server is ready to receive web requests."


def binary(name: str) -> str:
    """The path of a Prometheus tool; fails under ``$CI``, skips elsewhere, when missing."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI: scripts/setup.sh --prometheus installs it")
        pytest.skip(f"{name} not installed (scripts/test.sh installs it)")
    return path


class PrometheusServer:
    """``prometheus`` with ``config`` (a dict, written as YAML), its data in ``workdir``."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, start_timeout_s: float = 60.0) -> None:
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.start_timeout_s = start_timeout_s
        self.log: list[str] = []
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def __enter__(self) -> PrometheusServer:
        self._proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                "--web.listen-address=127.0.0.1:0",
                "--enable-feature=exemplar-storage",
                "--log.level=info",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read_log, name="prometheus-log", daemon=True).start()
        if not self._ready.wait(self.start_timeout_s) or not self.url:
            self.__exit__(None, None, None)
            raise RuntimeError("prometheus did not start:\n" + "".join(self.log[-30:]))
        return self

    def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:  # drained to the end, so the pipe never fills
            self.log.append(line)
            match = _LISTENING.search(line)
            if match:
                self.url = f"http://{match.group(1)}"
            if _READY in line:
                self._ready.set()
        self._ready.set()  # exited: let the starter see it

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    # --- HTTP API ------------------------------------------------------------
    def api(self, path: str, **params: str | float | list[str]) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a successful answer, else ``AssertionError``."""
        query = urllib.parse.urlencode(params, doseq=True)
        request = f"{self.url}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - our loopback server
                body = json.load(response)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        assert body.get("status") == "success", f"{path} {params}: {body.get('error', body)}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self.api("query", **params)
        return data["result"] if isinstance(data["result"], list) else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]  # type: ignore[no-any-return]

    def exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        return self.api("query_exemplars", query=expr, start=start, end=end)  # type: ignore[no-any-return]

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        return self.api("series", **{"match[]": [match], "start": start, "end": end})  # type: ignore[no-any-return]
