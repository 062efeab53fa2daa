"""OpenTelemetry spans for PyTorch Distributed Checkpoint (DCP).

Every DCP step (``save``, ``async_save``, ``load``, ``local_step``,
``global_step``, ``write_data``, ``read_data``, ``finish_checkpoint``,
``stage_state_dict``, ...) becomes a span, and all ranks of one checkpoint land
in one trace.

Usage::

    import dcp_otel
    import torch.distributed.checkpoint as dcp

    dcp_otel.instrument()                       # uses the global tracer provider
    dcp.save(state_dict, checkpoint_id="/ckpt/step-100")
    dcp_otel.uninstrument()

Or with no code change: ``opentelemetry-instrument python train.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dcp_otel import _selftelemetry
from dcp_otel.version import __version__

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from dcp_otel.elastic.handler import OTelMetricHandler
    from dcp_otel.instrumentor import DCPInstrumentor
    from dcp_otel.metrics.exposition import MetricsEndpoint, start_metrics_server
    from dcp_otel.tracing.training_step import set_training_step, training_step

#: Imported when first used: what needs torch (the instrumentor, the elastic handler) is not loaded by
#: ``import dcp_otel`` itself, so the command line (``dcp-otel report``, ``check``, ``--version``) and the
#: mixin run where torch is not installed.
_LAZY = {
    "DCPInstrumentor": "dcp_otel.instrumentor",
    "OTelMetricHandler": "dcp_otel.elastic.handler",
    "MetricsEndpoint": "dcp_otel.metrics.exposition",
    "start_metrics_server": "dcp_otel.metrics.exposition",
    "set_training_step": "dcp_otel.tracing.training_step",
    "training_step": "dcp_otel.tracing.training_step",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_otel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "DCPInstrumentor",
    "MetricsEndpoint",
    "OTelMetricHandler",
    "__version__",
    "diagnostics",
    "flush",
    "instrument",
    "set_training_step",
    "start_metrics_server",
    "training_step",
    "uninstrument",
]


def instrument(tracer_provider: TracerProvider | None = None, **options: Any) -> DCPInstrumentor:
    """Instrument DCP; a second call only warns. Returns the instrumentor.

    Args:
        tracer_provider: where spans go; default: the global provider.
        **options: see :class:`dcp_otel.config.InstrumentOptions` (``registry``,
            ``metrics_port``, ``run_id``, ``slowest_keys``, ``max_open_spans``,
            ``process_setup``, ``flush_timeout_s``, ``detail``, ``span_budget``,
            ``max_queued_operations``, ``meter_provider``, ``metrics``, ``step_pattern``).

    Raises:
        ValueError: an unknown option or a bad value.
    """
    from dcp_otel.instrumentor import DCPInstrumentor

    instrumentor = DCPInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, **options)
    return instrumentor


def uninstrument() -> None:
    """Undo :func:`instrument`: torch's original objects are restored."""
    from dcp_otel.instrumentor import DCPInstrumentor

    DCPInstrumentor().uninstrument()


def flush(timeout_s: float = 30.0, tracer_provider: TracerProvider | None = None) -> bool:
    """Wait for in-flight async uploads to end and their spans to be built, then flush the providers.

    The meter provider is flushed alongside the tracer provider when the
    OpenTelemetry metrics are on (an OTLP push now rather than at the next period).

    dcp-otel does this by itself at interpreter exit (within
    ``flush_timeout_s``); call it when you shut the provider down earlier, or
    want the spans out now: the upload span ends in the upload future's
    done-callback, which runs just after ``future.result()`` returns. ``tracer_provider`` defaults to the one
    spans go to (given to :func:`instrument`, else the global one). Returns
    ``False`` if ``timeout_s`` passed first: it never waits longer, even for a
    hung exporter (the SDK's own ``force_flush`` would). Never raises.

    Example::

        future = dcp.async_save(state, checkpoint_id=path)
        future.result()
        dcp_otel.flush()
    """
    from dcp_otel.instrumentor import DCPInstrumentor
    from dcp_otel.tracing.flushing import flush_all

    instrumentor = DCPInstrumentor()
    return flush_all(instrumentor.recorder, instrumentor.otel_metrics, timeout_s, tracer_provider)


def diagnostics() -> dict[str, int]:
    """Counts of what dcp-otel dropped or failed at, and the DCP spans open now.

    Example: ``{"open_spans": 0, "malformed_event": 2}``. Telemetry problems are
    counted here (and logged, rate-limited) instead of raised.
    """
    from dcp_otel.instrumentor import DCPInstrumentor

    recorder = DCPInstrumentor().recorder
    result = {"open_spans": recorder.open_count() if recorder is not None else 0}
    result.update(_selftelemetry.counts())
    return result
