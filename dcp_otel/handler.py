"""The ``logging.Handler`` we attach to torch's DCP logger.

torch's ``_dcp_method_logger`` logs a start, an end and (for some functions) an
exception record for every DCP call, synchronously, on the calling thread. This
handler hands each record to a :class:`~dcp_otel.spans.SpanRecorder`.

It overrides :meth:`handle` rather than :meth:`emit`: the base class would take
a per-handler lock around every record, serializing the async save thread
against the training thread for nothing (the recorder is thread-safe).

Usage::

    handler = DCPLogHandler(recorder)
    dcp_logger.addHandler(handler)
"""

from __future__ import annotations

import logging
import sys

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.events import MalformedEvent, parse_event
from dcp_otel.spans import SpanRecorder

_KEY_PREFIX = semconv.STATEFUL_KEY_PREFIX


class DCPLogHandler(logging.Handler):
    """Feeds DCP log records to a recorder; never raises, never blocks on export."""

    def __init__(self, recorder: SpanRecorder) -> None:
        super().__init__(level=logging.NOTSET)
        self.recorder = recorder

    def handle(self, record: logging.LogRecord) -> bool:  # noqa: D102 - see class docstring
        try:
            msg = record.msg
            # Hot path: a 10,000-key state dict logs 20,000 per-key records.
            if type(msg) is dict:
                func_name = msg.get("func_name")
                if type(func_name) is str and func_name.startswith(_KEY_PREFIX):
                    kind, uuid, time_ns = msg.get("event"), msg.get("uuid"), msg.get("time")
                    if kind in ("start", "end", "exception") and type(uuid) is str and type(time_ns) is int:
                        self.recorder.on_key_event(kind, uuid, func_name, time_ns)
                        return True
            event = parse_event(msg)
        except MalformedEvent as exc:
            report("malformed_event", "dropped a DCP log record: %s", exc)
            return True
        except Exception:  # noqa: BLE001 - telemetry never raises into training
            report("handler_error", "dcp_otel failed to read a DCP log record", exc_info=True)
            return True
        # torch logs an exception from inside its ``except`` block: the
        # exception object (type, traceback) is the one being handled now.
        exc_value = sys.exc_info()[1] if event.kind == "exception" else None
        self.recorder.on_event(event, exc_value)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)
