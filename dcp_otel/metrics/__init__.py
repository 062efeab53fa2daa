"""Checkpoint metrics: one catalogue (:mod:`dcp_otel.semconv`), two sinks, and how they leave the process.

* :mod:`~dcp_otel.metrics.prometheus`: the sink protocol, the prometheus-client
  sink with exemplars, and the fan-out to several sinks;
* :mod:`~dcp_otel.metrics.otel`: the same catalogue as OpenTelemetry instruments (OTLP push);
* :mod:`~dcp_otel.metrics.exposition`: per-rank endpoints, port fallback,
  multiprocess mode, the last scrape;
* :mod:`~dcp_otel.metrics.relay`: the async save daemon's metrics, over a pipe, into its rank's;
* :mod:`~dcp_otel.metrics.file_sd`: Prometheus file_sd target files.
"""
