"""Announce this process's metrics endpoint to Prometheus file-based discovery.

Ranks come and go with every job, so a static scrape list goes stale. When a
folder is configured (``$DCP_OTEL_FILE_SD_DIR``, or ``file_sd_dir=`` of
:func:`dcp_otel.start_metrics_server`), each endpoint writes one target file
there, in the format of Prometheus's ``file_sd_configs``, and removes it when
it closes or the process exits. ``exporters/prometheus/prometheus.yml`` reads
``rank-*.json`` into the ranks' job and ``agent-*.json`` into the torchelastic
agent's job.

A file is written whole to a temporary name and renamed, so Prometheus never
reads half of one. A folder that cannot be written never breaks training: it
is reported (counted as ``file_sd_error`` in :func:`dcp_otel.diagnostics`).

Usage::

    # DCP_OTEL_FILE_SD_DIR=/shared/prometheus/targets torchrun ... (zero code), or:
    endpoint = dcp_otel.start_metrics_server(file_sd_dir="/shared/prometheus/targets")
    # -> /shared/prometheus/targets/rank-<host>-9710.json:
    #    [{"targets": ["<host>:9710"], "labels": {}}]
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from pathlib import Path
from typing import Literal

from dcp_otel import semconv
from dcp_otel._selftelemetry import report

Role = Literal["rank", "agent"]
_WILDCARD = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 - addresses meaning "every interface"


def configured_dir(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """``explicit``, else ``$DCP_OTEL_FILE_SD_DIR``, else ``None`` (no discovery files)."""
    if explicit is not None:
        return Path(explicit)
    value = os.environ.get(semconv.ENV_FILE_SD_DIR, "").strip()
    return Path(value) if value else None


def target_host(bind_addr: str) -> str:
    """The address Prometheus should scrape for an endpoint bound to ``bind_addr``.

    Bound to every interface, the endpoint is reached by this host's name;
    bound to one address, by that address.
    """
    host = socket.getfqdn() if bind_addr in _WILDCARD else bind_addr
    return f"[{host}]" if ":" in host else host


class TargetFile:
    """One endpoint's discovery file; :meth:`remove` (also run at exit) deletes it."""

    def __init__(self, folder: Path, role: Role, bind_addr: str, port: int) -> None:
        host = target_host(bind_addr)
        name = f"{role}-{host.strip('[]').replace(':', '_')}-{port}.json"
        self.path = folder / name
        self._pid = os.getpid()
        # No target labels: the series already say their rank, and ``instance`` their host and port.
        group = [{"targets": [f"{host}:{port}"], "labels": {}}]
        folder.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{name}.{self._pid}.tmp")  # not matched by *.json
        partial.write_text(json.dumps(group, indent=1) + "\n")
        os.replace(partial, self.path)
        atexit.register(self.remove)

    def remove(self) -> None:
        """Delete the file (only in the process that wrote it: not in forked children)."""
        if os.getpid() != self._pid:
            return
        atexit.unregister(self.remove)
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            report("file_sd_error", "dcp_otel: cannot remove the discovery file %s (%s)", self.path, exc)


def announce(folder: Path | None, role: Role, bind_addr: str, port: int) -> TargetFile | None:
    """Write the discovery file of an endpoint, if a folder is configured; never raises on I/O."""
    if folder is None:
        return None
    try:
        return TargetFile(folder, role, bind_addr, port)
    except OSError as exc:
        report("file_sd_error", "dcp_otel: cannot write a discovery file in %s (%s)", folder, exc)
        return None
