"""What each metrics sink costs: Prometheus only, OpenTelemetry only, and both.

    .venv/bin/python benchmarks/metric_sinks.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/metric_sinks.py --quick

One DCP operation of ``steps`` logged steps (torch's own ``_dcp_method_logger``,
so every step logs its start and end as in a real save) is run with each sink
setting, interleaved, and two costs are measured per step:

* on the caller's thread (the training loop): the wall time of the operation,
  against an uninstrumented run in the same loop. The sinks are fed by the
  background builder, so this should not move with the sink setting;
* on the builder's own thread: the time it spent building the operation's
  metrics and spans (``SpanBuilder.busy_ns``), which does move: each sink's
  observation of each step is made there.

The OpenTelemetry side records into a real SDK ``MeterProvider`` with a
periodic reader and an exporter that discards (the export, a network cost on
the reader's own thread, is not counted).
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, interleave, median, per_call  # noqa: E402

import dcp_otel  # noqa: E402

#: The settings compared, as DCP_OTEL_METRICS would say them.
SINKS = ("prometheus", "opentelemetry", "prometheus,opentelemetry")


class DiscardingSpans(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class DiscardingMetrics(MetricExporter):
    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def measure(repeats: int, steps: int) -> dict[str, dict[str, float]]:
    """Per setting, per step: ``step_us`` (a whole step on the caller's thread), ``caller_us`` (what
    instrumenting added to it) and ``builder_us`` (the builder thread's time)."""
    from torch.distributed.checkpoint.logger import _dcp_method_logger

    spans = TracerProvider()
    spans.add_span_processor(SimpleSpanProcessor(DiscardingSpans()))
    meters = MeterProvider([PeriodicExportingMetricReader(DiscardingMetrics(), export_interval_millis=60_000)])

    def write_data() -> None:
        pass

    step = _dcp_method_logger()(write_data)

    def save() -> None:
        for _ in range(steps):
            step()

    operation = _dcp_method_logger()(save)

    def short() -> None:
        step()

    warm_up = _dcp_method_logger()(short)

    def sink(name: str) -> Measures:
        dcp_otel.instrument(tracer_provider=spans, registry=CollectorRegistry(), meter_provider=meters,
                            metrics=name, detail="full")  # fmt: skip
        recorder = dcp_otel.DCPInstrumentor().recorder
        assert recorder is not None
        warm_up()  # a job instruments once: the first operation's one-off costs are not per step
        recorder.drain(60.0)
        busy_before = recorder.builder.busy_ns
        caller = per_call(operation)
        recorder.drain(60.0)
        builder = (recorder.builder.busy_ns - busy_before) / 1e9
        dcp_otel.uninstrument()
        return {"caller": caller, "builder": builder}

    arms: dict[str, Callable[[], Measures]] = {"plain": lambda: {"caller": per_call(operation)}}
    arms.update({name: functools.partial(sink, name) for name in SINKS})
    found = interleave(arms, repeats)  # rotated: drift hits every arm alike
    meters.shutdown()
    spans.shutdown()
    plain = median(found, "plain", "caller")
    return {
        name: {"step_us": median(found, name, "caller") / steps * 1e6,
               "caller_us": (median(found, name, "caller") - plain) / steps * 1e6,
               "builder_us": median(found, name, "builder") / steps * 1e6}  # fmt: skip
        for name in SINKS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    found = measure(repeats=5 if args.quick else 15, steps=2_000 if args.quick else 10_000)
    print(f"{'metrics sinks':<28} {'step us':>9} {'added us':>9} {'builder us':>11}  (per DCP step)")
    for name, row in found.items():
        print(f"{name:<28} {row['step_us']:>9.2f} {row['caller_us']:>9.2f} {row['builder_us']:>11.2f}")


if __name__ == "__main__":
    main()
