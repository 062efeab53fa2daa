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
    #    [{"targets": ["<host>:9710"],
    #      "labels": {"dcp_run_id": "<run id>", "host_name": "<host>", "job": "<OTEL_SERVICE_NAME>"}}]

The labels tell one run from another on a Prometheus that scrapes a whole
cluster: ``dcp_run_id`` is the run id dcp-otel puts in trace ids (the same on
every rank: ``$DCP_OTEL_RUN_ID``, torchrun's rendezvous id, SLURM's job id),
``host_name`` the node, and ``job`` the job's name where one is set
(``$OTEL_SERVICE_NAME`` or ``service.name`` in ``$OTEL_RESOURCE_ATTRIBUTES``;
a target label wins over the scrape config's ``job_name``). They are the names
the OTel Collector's Prometheus exporter gives the same resource attributes, so
dashboards and rules select a run the same way whether it was scraped or pushed.
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
from dcp_otel.tracing.trace_ids import environment_run_id

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


def job_name() -> str | None:
    """The job's name as OpenTelemetry's resource says it (``service.name``), if one was set."""
    # Read as the SDK reads it (OTEL_SERVICE_NAME over OTEL_RESOURCE_ATTRIBUTES), by its environment detector
    # alone: Resource.create() would also run every detector configured, some of which ask the network.
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector

    name = str(OTELResourceDetector().detect().attributes.get(SERVICE_NAME, ""))
    return name or None


def target_labels(run_id: str | None = None) -> dict[str, str]:
    """The labels of this process's target: its run, host and (where set) the job's name.

    ``run_id`` is the ``run_id=`` option (``None``: as every rank resolves it, from the environment).
    """
    labels = {semconv.LABEL_RUN_ID: environment_run_id(run_id), semconv.LABEL_HOST: socket.gethostname()}
    job = job_name()
    if job:
        labels[semconv.LABEL_JOB] = job
    return labels


class TargetFile:
    """One endpoint's discovery file; :meth:`remove` (also run at exit) deletes it."""

    def __init__(self, folder: Path, role: Role, bind_addr: str, port: int, labels: dict[str, str] | None = None) -> None:
        host = target_host(bind_addr)
        name = f"{role}-{host.strip('[]').replace(':', '_')}-{port}.json"
        self.path = folder / name
        self.target = f"{host}:{port}"
        self._pid = os.getpid()
        folder.mkdir(parents=True, exist_ok=True)
        self.write(labels if labels is not None else target_labels())
        atexit.register(self.remove)

    def write(self, labels: dict[str, str]) -> None:
        """(Re)write the file whole, with these target labels (the series say their rank; these say which
        run, node and job they belong to)."""
        partial = self.path.with_name(f".{self.path.name}.{self._pid}.tmp")  # not matched by *.json
        partial.write_text(json.dumps([{"targets": [self.target], "labels": labels}], indent=1) + "\n")
        os.replace(partial, self.path)

    def remove(self) -> None:
        """Delete the file (only in the process that wrote it: not in forked children)."""
        if os.getpid() != self._pid:
            return
        atexit.unregister(self.remove)
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            report("file_sd_error", "dcp_otel: cannot remove the discovery file %s (%s)", self.path, exc)


def announce(folder: Path | None, role: Role, bind_addr: str, port: int, run_id: str | None = None) -> TargetFile | None:
    """Write the discovery file of an endpoint, if a folder is configured; never raises on I/O."""
    if folder is None:
        return None
    try:
        return TargetFile(folder, role, bind_addr, port, target_labels(run_id))
    except OSError as exc:
        report("file_sd_error", "dcp_otel: cannot write a discovery file in %s (%s)", folder, exc)
        return None
