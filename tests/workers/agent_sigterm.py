"""A torchelastic agent that gets the scheduler's SIGTERM while it records one of its own metrics.

``python agent_sigterm.py launch [--plain] TORCHRUN_ARGS...`` runs ``dcp-otel-run`` (or, with
``--plain``, torchrun) with TORCHRUN_ARGS. Once every worker has started, the next
``_monitor_workers`` metric of the agent's loop delivers SIGTERM to the agent from inside its
metric sink: with dcp-otel, from a span processor that ``OTelMetricHandler`` calls inside its
``try`` (as an SDK set up by ``opentelemetry-instrument`` would be called); plain, from a
torchelastic ``MetricHandler`` of its own at the same point.

``python agent_sigterm.py worker``: a worker that writes ``$OUT_DIR/started-RANK``, waits
(60 s at most), then writes ``$OUT_DIR/finished-RANK``: a job the agent must stop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

MONITOR = "_monitor_workers"


def everyone_started() -> bool:
    out = Path(os.environ["OUT_DIR"])
    return len(list(out.glob("started-*"))) == int(os.environ["WORKERS"])


class SigtermOnce:
    """Sends SIGTERM to this process the first time it is asked while every worker runs."""

    sent = False

    def __call__(self, name: str) -> None:
        if not self.sent and name.endswith(MONITOR) and everyone_started():
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the agent's handler at the next bytecode: in here


def launch(plain: bool, argv: list[str]) -> None:
    sigterm = SigtermOnce()
    if plain:
        from torch.distributed.elastic.metrics.api import MetricHandler, configure
        from torch.distributed.run import main

        class Sink(MetricHandler):
            def emit(self, metric_data: Any) -> None:
                sigterm(metric_data.name.removesuffix(".duration.ms"))

        configure(Sink())
        main(argv)
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from dcp_otel.elastic.launcher import main as dcp_otel_run

    class AtSpanStart(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            sigterm(span.name)

    provider = TracerProvider()
    provider.add_span_processor(AtSpanStart())
    trace.set_tracer_provider(provider)
    dcp_otel_run(argv)


def work() -> None:
    out, rank = Path(os.environ["OUT_DIR"]), os.environ["RANK"]
    (out / f"started-{rank}").write_text(str(os.getpid()))
    threading.Event().wait(60)  # the agent stops this job long before
    (out / f"finished-{rank}").write_text("")


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        work()
    else:
        plain = sys.argv[2:3] == ["--plain"]
        launch(plain, sys.argv[3 if plain else 2 :])
