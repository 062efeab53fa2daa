"""Checkpoint metrics observed in torch's checkpoint daemon, counted by the rank that owns it.

With ``AsyncCheckpointerType.PROCESS`` the background ``save`` runs in a daemon
process. Its metrics belong on the rank's own endpoint (one scrape target per
rank, the same ``rank`` label), so the daemon does not record them: a
:class:`MetricsRelay` stands in for :class:`~dcp_otel.metrics.prometheus.CheckpointMetrics`
there, queues each observation, and :meth:`MetricsRelay.send` ships them to the
rank over a pipe after every save; :func:`drain` applies them to the rank's real
metrics when the save's response arrives.

The pipe never blocks the daemon: messages are JSON below ``PIPE_BUF`` bytes, so
a write is atomic, and the writer is non-blocking, so a full pipe (a rank that
stopped reading) drops the message with a counted warning instead of stalling
the checkpoint.

Usage::

    relay = MetricsRelay(writer)            # in the daemon, instead of CheckpointMetrics
    relay.step_done("async_save", "write_data", "0", 0.4, None)
    relay.send()                            # after the save
    drain(reader, metrics)                  # in the rank, when the save returned
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.live.status import board
from dcp_otel.metrics.prometheus import Exemplar, ForwardingSink, LiveEntry, MetricsSink

#: The observations a daemon can make (the operation itself belongs to the rank).
RELAYED = frozenset(
    {"operation_done", "step_done", "bytes_written", "bytes_read", "bytes_staged", "async_handed_off", "async_phase_done", "async_upload_done",
     "stalled", "failure_started"}
)  # fmt: skip
#: Not a metric: where the daemon's open operations are now (its live progress), replacing the last one sent.
PROGRESS = "progress"
#: Not a metric: a stall report of the daemon's, for the rank's board (``dcp-otel status`` reads it from the rank).
STALL_REPORT = "stall_report"
#: The innermost part of a relayed report's stack that is kept (it must fit in one message).
MAX_RELAYED_STACK = 2800
_REPORT_FIELDS = ("operation", "step", "rank", "seconds", "threshold_s", "stack", "collective", "where")
#: Below POSIX PIPE_BUF (4096 on Linux) with room for the connection's 4-byte header.
MAX_MESSAGE_BYTES = 3800
#: Observations waiting to be sent; past it the oldest ones are dropped and counted.
MAX_QUEUED = 4096
#: Messages applied per drain, so a flooded pipe cannot hold up the rank.
MAX_DRAINED = 4096


class MetricsRelay(ForwardingSink):
    """The daemon's stand-in for :class:`~dcp_otel.metrics.prometheus.CheckpointMetrics`: same methods, queued."""

    def __init__(self, writer: Connection | None) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._queue: list[list[Any]] = []
        if writer is not None:
            os.set_blocking(writer.fileno(), False)

    def _forward(self, name: str, *args: Any) -> None:
        with self._lock:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.pop(0)
                report("relay_dropped", "dropped a checkpoint metric of the async save process: too many queued")
            self._queue.append([name, *args])

    def training_blocked(self, operation: str, rank: str, seconds: float) -> None:
        """Not relayed: a checkpoint process's own calls block no training (its rank counts its async save's)."""

    def training_step(self, overlaps: str, rank: str, seconds: float, exemplar: Exemplar | None) -> None:
        """Not relayed: a checkpoint process takes no training steps (its rank's hook sees them)."""

    def training_interference(self, operation: str, rank: str, seconds: float) -> None:
        """Not relayed: measured on the rank, from its own steps."""

    def progress(self, where: str, entries: list[LiveEntry]) -> None:
        """Queue where this process's open operations are now (``[]``: none); :meth:`send` ships it."""
        self._forward(PROGRESS, where, [list(entry) for entry in entries])

    def stall_report(self, report: dict[str, Any]) -> None:
        """Queue a stall report (:meth:`~dcp_otel.live.status.StallBoard.record`'s fields) for the rank's board; a long
        stack keeps its innermost frames."""
        stack = report.get("stack")
        if isinstance(stack, str) and len(stack) > MAX_RELAYED_STACK:
            report = {**report, "stack": "...\n" + stack[-MAX_RELAYED_STACK:]}
        self._forward(STALL_REPORT, report)

    def send(self) -> None:
        """Ship everything queued to the rank; never blocks, never raises."""
        with self._lock:
            queued, self._queue = self._queue, []
        if self._writer is None or not queued:
            return
        for message in _pack(queued):
            try:
                self._writer.send_bytes(message)
            except BlockingIOError:
                report("relay_dropped", "dropped checkpoint metrics of the async save process: the rank is not reading")
            except (OSError, ValueError):  # the rank is gone (closed pipe); nothing left to tell
                report("relay_dropped", "dropped checkpoint metrics of the async save process: the pipe is closed")
                return


def _pack(observations: list[list[Any]]) -> list[bytes]:
    """JSON arrays of observations, each message at most MAX_MESSAGE_BYTES."""
    messages: list[bytes] = []
    current: list[bytes] = []
    size = 2
    for observation in observations:
        encoded = json.dumps(observation, separators=(",", ":")).encode()
        if len(encoded) + 3 > MAX_MESSAGE_BYTES:
            report("relay_dropped", "dropped an oversized checkpoint metric of the async save process")
            continue
        if current and size + len(encoded) + 1 > MAX_MESSAGE_BYTES:
            messages.append(b"[" + b",".join(current) + b"]")
            current, size = [], 2
        current.append(encoded)
        size += len(encoded) + 1
    if current:
        messages.append(b"[" + b",".join(current) + b"]")
    return messages


def drain(reader: Connection, metrics: MetricsSink | None,
          on_progress: Callable[[str, list[LiveEntry]], None] | None = None) -> int:  # fmt: skip
    """Apply the daemon's queued observations to ``metrics`` (its progress to ``on_progress``); return how many.

    Never raises. At the end of the pipe (the daemon exited), its progress is
    ``[]``: nothing of it is open any more.
    """
    applied = 0
    try:
        for _ in range(MAX_DRAINED):
            if not reader.poll(0):
                break
            for observation in json.loads(reader.recv_bytes()):
                name = observation[0] if isinstance(observation, list) and observation else None
                if name == PROGRESS:
                    if on_progress is not None and len(observation) == 3:
                        on_progress(str(observation[1]), [tuple(e) for e in observation[2] if len(e) == 5])
                    continue
                if name == STALL_REPORT:  # onto this process's board, served beside its metrics
                    if len(observation) == 2 and isinstance(observation[1], dict):
                        board().record(**{k: v for k, v in observation[1].items() if k in _REPORT_FIELDS})
                    continue
                if metrics is None:
                    continue
                if name not in RELAYED:
                    report("relay_dropped", "dropped an unknown metric from the async save process: %r", name)
                    continue
                getattr(metrics, name)(*observation[1:])
                applied += 1
    except (EOFError, OSError):  # the daemon exited: nothing more will come, nothing of it is open
        if on_progress is not None:
            on_progress("", [])
    except Exception as exc:  # noqa: BLE001 - a garbled message must not break the save's caller
        reraise_if_signalled(exc)
        report("metrics_error", "dcp_otel failed to apply metrics from the async save process", exc_info=True)
    return applied
