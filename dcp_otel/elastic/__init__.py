"""torchelastic: its metrics through :class:`~dcp_otel.elastic.handler.OTelMetricHandler`, and ``dcp-otel-run``.

* :mod:`~dcp_otel.elastic.handler`: the ``MetricHandler`` for
  ``torch.distributed.elastic.metrics.configure(...)``;
* :mod:`~dcp_otel.elastic.launcher`: ``dcp-otel-run``, torchrun with the agent observable.
"""
