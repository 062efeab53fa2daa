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

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixin.promapi import PrometheusAPI

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


class PrometheusServer(PrometheusAPI):
    """``prometheus`` with ``config`` (a dict, written as YAML), its data in ``workdir``;
    its HTTP API once started."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, start_timeout_s: float = 60.0,
                 agent: bool = False, flags: tuple[str, ...] = ()) -> None:  # fmt: skip
        """``agent``: Prometheus in agent mode (scrape and remote-write only); ``flags``: more of its flags."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.agent = agent
        self.flags = flags
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.start_timeout_s = start_timeout_s
        self.log: list[str] = []
        super().__init__("")
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def __enter__(self) -> PrometheusServer:
        self._proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={self.config_path}",
                *([f"--storage.agent.path={self.workdir / 'agent-data'}", "--enable-feature=agent,exemplar-storage"]
                  if self.agent else [f"--storage.tsdb.path={self.workdir / 'data'}", "--enable-feature=exemplar-storage"]),
                "--web.listen-address=127.0.0.1:0",
                "--log.level=info",
                *self.flags,
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
        ready = False
        for line in self._proc.stderr:  # drained to the end, so the pipe never fills
            self.log.append(line)
            match = _LISTENING.search(line)
            if match:
                self.url = f"http://{match.group(1)}"
            ready = ready or _READY in line
            # Both lines, in either order: the web server logs its address on a goroutine of its own, which came
            # after "ready" once in a CI run (the starter read no address and stopped it).
            if ready and self.url:
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
