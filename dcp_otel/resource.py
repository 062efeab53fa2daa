"""Which host, rank and job run a process is: OpenTelemetry resource attributes.

Spans carry the rank as attributes already; the *resource* says it once per
process, which is what trace backends group and filter by (Jaeger's process
tags, Tempo's resource attributes) and what the OTel Collector's Prometheus
exporter turns into ``target_info``. Read from what ``torchrun``, SLURM and
dcp-otel's own variables set, so it works before ``init_process_group``.

Turn it on with no code, for ``opentelemetry-instrument`` (``dcp-otel-run``
sets it for its workers)::

    OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=dcp_otel

or in code::

    resource = Resource.create({"service.name": "trainer"}).merge(TorchDistributedResourceDetector().detect())
"""

from __future__ import annotations

import os
import socket

from opentelemetry.sdk.resources import Resource, ResourceDetector

from dcp_otel import semconv
from dcp_otel.tracing.trace_ids import environment_run_id


class TorchDistributedResourceDetector(ResourceDetector):
    """``host.name``, ``dcp.rank``, ``dcp.local_rank``, ``dcp.world_size`` and ``dcp.run_id``.

    The run id is the one dcp-otel puts in trace ids (``$DCP_OTEL_RUN_ID``,
    ``$TORCHELASTIC_RUN_ID``, ``$SLURM_JOB_ID``, ...): the same on every rank.
    Rank attributes are left out where the variables are not set.
    """

    def detect(self) -> Resource:
        env = os.environ
        attributes: dict[str, str | int] = {"host.name": socket.gethostname()}
        for name, key in (("RANK", semconv.ATTR_RANK), ("LOCAL_RANK", semconv.RESOURCE_LOCAL_RANK),
                          ("WORLD_SIZE", semconv.ATTR_WORLD_SIZE)):  # fmt: skip
            value = env.get(name, "").strip()
            if value.isdigit():
                attributes[key] = int(value)
        attributes[semconv.ATTR_RUN_ID] = environment_run_id()
        return Resource(attributes)
