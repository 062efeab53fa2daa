"""Grafana's datasources for dcp-otel: Prometheus, whose exemplars link to the checkpoint's trace, and a trace
datasource for each backend (Jaeger and Tempo), the one ``traces_datasource_type`` names with
``traces_datasource_uid``.

Usage::

    python -m mixin --traces-datasource-type tempo      # exemplars and trace links open Tempo
"""

from __future__ import annotations

from typing import Any

from dcp_otel import semconv as sc
from mixin.config import TRACE_BACKENDS, MixinConfig

PROMETHEUS_UID = "dcp-otel-prometheus"


def trace_uid(cfg: MixinConfig, backend: str) -> str:
    """The uid of ``backend``'s datasource: the configured one for the chosen backend, ``dcp-otel-<backend>`` else."""
    return cfg.traces_datasource_uid if backend == cfg.traces_datasource_type else f"dcp-otel-{backend}"


def datasources(cfg: MixinConfig) -> dict[str, Any]:
    """The provisioning file (grafana/provisioning/datasources/dcp-otel.yaml)."""
    found: list[dict[str, Any]] = [{
        "name": "Prometheus",
        "uid": PROMETHEUS_UID,
        "type": "prometheus",
        "access": "proxy",
        "url": "http://host.docker.internal:9090",  # Prometheus on the host network (compose.yaml)
        "isDefault": True,
        "jsonData": {
            "timeInterval": "15s",  # the scrape interval: $__rate_interval is at least 4x this
            # Each exemplar's trace id opens the checkpoint's trace.
            "exemplarTraceIdDestinations": [{"name": sc.EXEMPLAR_TRACE_ID, "datasourceUid": cfg.traces_datasource_uid,
                                             "urlDisplayLabel": "Checkpoint trace"}],  # fmt: skip
        },
    }]
    for backend, url in TRACE_BACKENDS.items():
        found.append({"name": backend.capitalize(), "uid": trace_uid(cfg, backend), "type": backend,
                      "access": "proxy", "url": url})  # fmt: skip
    return {"apiVersion": 1, "datasources": found}
