"""What letting a signal handler's exception through costs: the agent's loop, and an error path.

    .venv/bin/python benchmarks/signal_exceptions.py            # ~5 s on 2 cores
    .venv/bin/python benchmarks/signal_exceptions.py --quick

Two measurements, each side by side in one run, interleaved:

* **the torchelastic agent's loop**: each monitor interval (0.1 s with torchrun's
  default) the agent records four metrics through torch's own ``put_metric``:
  ``_monitor_workers`` success and duration, remaining restarts, the group's state.
  Timed with ``OTelMetricHandler`` configured (as ``dcp-otel-run`` does, Prometheus
  sink) against torch's ``NullMetricHandler`` (torch without dcp-otel); what the
  agent pays is the difference, also as a share of the interval. The clauses
  that check for a signal's exception are not on this path unless something fails.
* **an error path**: an ``except Exception`` that catches an error raised two frames
  down, with and without ``reraise_if_signalled`` (torch's agent SIGTERM handler
  installed, as in the agent). Only paid when a telemetry error happens on the
  main thread.

What it leaves out: a loaded node, where a process can be descheduled inside the
metric handler (the handler's share of the loop only grows there), and the
OpenTelemetry sink (``metric_sinks.py`` measures the sinks).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry
from torch.distributed.elastic.metrics import api as elastic_metrics
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dcp_otel import OTelMetricHandler  # noqa: E402
from dcp_otel.live.signal_exceptions import reraise_if_signalled  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, interleave, median, per_call  # noqa: E402

MONITOR_INTERVAL_S = 0.1  # torchrun's default --monitor-interval
GROUPS = ("torchelastic", "workers")


def agent_loop() -> None:
    """What the agent's loop records each interval (``_invoke_run`` and ``@prof`` on ``_monitor_workers``)."""
    elastic_metrics.put_metric("LocalElasticAgent._monitor_workers.success", 1, "torchelastic")
    elastic_metrics.put_metric("LocalElasticAgent._monitor_workers.duration.ms", 3, "torchelastic")
    elastic_metrics.put_metric("default.remaining_restarts", 0, "workers")
    elastic_metrics.put_metric("default.healthy", 1, "workers")


def configure(handler: elastic_metrics.MetricHandler) -> None:
    for group in GROUPS:
        elastic_metrics.configure(handler, group)


def _two_frames_down() -> None:
    raise ValueError("a telemetry error")


def clause_without() -> None:
    try:
        _two_frames_down()
    except Exception:  # noqa: BLE001, S110 - the clause as it was
        pass


def clause_with() -> None:
    try:
        _two_frames_down()
    except Exception as exc:  # noqa: BLE001 - the clause as it is
        reraise_if_signalled(exc)


def measure(repeats: int, calls: int) -> dict[str, float]:
    """Median microseconds per call: ``loop torch`` and ``loop dcp-otel`` (the agent's loop with each handler),
    ``error without`` and ``error with`` (the error path), all four interleaved."""

    def timed(call: Callable[[], None], handler: elastic_metrics.MetricHandler | None = None) -> Callable[[], Measures]:
        def arm() -> Measures:
            if handler is not None:
                configure(handler)
            return {"us": per_call(call, calls) * 1e6}

        return arm

    arms = {"loop torch": timed(agent_loop, elastic_metrics.NullMetricHandler()),
            "loop dcp-otel": timed(agent_loop, OTelMetricHandler(CollectorRegistry(), metrics="prometheus")),
            "error without": timed(clause_without), "error with": timed(clause_with)}  # fmt: skip
    previous = signal.signal(signal.SIGTERM, _terminate_process_handler)  # the agent's own handler
    try:
        found = interleave(arms, repeats)  # drift hits every side alike
    finally:
        signal.signal(signal.SIGTERM, previous)
        configure(elastic_metrics.NullMetricHandler())
    return {name: median(found, name, "us") for name in arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a check that it runs)")
    args = parser.parse_args()
    m = measure(repeats=3 if args.quick else 15, calls=500 if args.quick else 5_000)
    added = m["loop dcp-otel"] - m["loop torch"]
    print(f"agent loop (4 metrics): torch {m['loop torch']:.1f} us, with OTelMetricHandler {m['loop dcp-otel']:.1f} us "
          f"(x{m['loop dcp-otel'] / m['loop torch']:.1f}); added {added:.1f} us = "
          f"{added / (MONITOR_INTERVAL_S * 1e6) * 100:.3f}% of a {MONITOR_INTERVAL_S} s monitor interval")
    print(f"error path (except Exception, raised 2 frames down): without the check {m['error without']:.2f} us, "
          f"with reraise_if_signalled {m['error with']:.2f} us (x{m['error with'] / m['error without']:.1f}; "
          f"+{m['error with'] - m['error without']:.2f} us per error on the main thread)")


if __name__ == "__main__":
    main()
