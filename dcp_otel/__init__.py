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

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from dcp_otel import _selftelemetry
from dcp_otel.elastic import OTelMetricHandler
from dcp_otel.exposition import MetricsEndpoint, start_metrics_server
from dcp_otel.instrumentor import DCPInstrumentor
from dcp_otel.version import __version__

__all__ = [
    "DCPInstrumentor",
    "MetricsEndpoint",
    "OTelMetricHandler",
    "__version__",
    "diagnostics",
    "flush",
    "instrument",
    "start_metrics_server",
    "uninstrument",
]


def instrument(tracer_provider: TracerProvider | None = None, **options: Any) -> DCPInstrumentor:
    """Instrument DCP; a second call only warns. Returns the instrumentor.

    Args:
        tracer_provider: where spans go; default: the global provider.
        **options: see :class:`dcp_otel.config.InstrumentOptions` (``registry``,
            ``run_id``, ``slowest_keys``, ``max_open_spans``).

    Raises:
        ValueError: an unknown option or a bad value.
    """
    instrumentor = DCPInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, **options)
    return instrumentor


def uninstrument() -> None:
    """Undo :func:`instrument`: torch's original objects are restored."""
    DCPInstrumentor().uninstrument()


def flush(timeout_s: float = 30.0, tracer_provider: TracerProvider | None = None) -> bool:
    """Wait for in-flight async uploads' spans to end, then flush the provider.

    Call it before exiting a training script that used ``async_save``: the
    upload span ends in the upload future's done-callback, which runs just
    after ``future.result()`` returns. ``tracer_provider`` defaults to the one
    spans go to (given to :func:`instrument`, else the global one). Returns
    ``False`` if ``timeout_s`` passed first. Never raises.

    Example::

        future = dcp.async_save(state, checkpoint_id=path)
        future.result()
        dcp_otel.flush()
    """
    deadline = time.monotonic() + timeout_s
    recorder = DCPInstrumentor().recorder
    done = recorder.wait_for_uploads(timeout_s) if recorder is not None else True
    if tracer_provider is not None:
        provider = tracer_provider
    else:  # the provider our spans go to, not necessarily the global one
        provider = recorder.provider() if recorder is not None else trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        try:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            done = bool(force_flush(remaining_ms)) and done
        except Exception:  # noqa: BLE001 - a broken exporter must not break the caller
            _selftelemetry.report("flush_error", "dcp_otel.flush: the tracer provider failed to flush", exc_info=True)
            return False
    return done


def diagnostics() -> dict[str, int]:
    """Counts of what dcp-otel dropped or failed at, and the DCP spans open now.

    Example: ``{"open_spans": 0, "malformed_event": 2}``. Telemetry problems are
    counted here (and logged, rate-limited) instead of raised.
    """
    recorder = DCPInstrumentor().recorder
    result = {"open_spans": recorder.open_count() if recorder is not None else 0}
    result.update(_selftelemetry.counts())
    return result
