"""The ``logging.Handler`` we attach to torch's DCP logger.

torch's ``_dcp_method_logger`` logs a start, an end and (for some functions) an
exception record for every DCP call, synchronously, on the calling thread. This
handler hands each record to a :class:`~dcp_otel.tracing.tracker.SpanRecorder`.

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
from dcp_otel.tracing.tracker import SpanRecorder

_KEY_PREFIX = semconv.STATEFUL_KEY_PREFIX
_KINDS = frozenset(("start", "end", "exception"))


class DCPLogHandler(logging.Handler):
    """Feeds DCP log records to a recorder; never raises, never blocks on export."""

    def __init__(self, recorder: SpanRecorder) -> None:
        super().__init__(level=logging.NOTSET)
        self.recorder = recorder
        self._fast = recorder.on_record

    def handle(self, record: logging.LogRecord) -> bool:  # noqa: D102 - see class docstring
        # The two records of every DCP step go straight to the recorder's hot path;
        # everything else (operations, per-key calls, exceptions, malformed records) comes here.
        if self._fast(record):
            return True
        try:
            msg = record.msg
            if type(msg) is dict:  # a 10,000-key state dict logs 20,000 per-key records: no event object
                kind, call_id, func_name, time_ns = msg.get("event"), msg.get("uuid"), msg.get("func_name"), msg.get("time")
                if type(call_id) is str and type(func_name) is str and type(time_ns) is int and call_id and time_ns > 0 \
                        and func_name.startswith(_KEY_PREFIX) and kind in _KINDS:  # fmt: skip
                    self.recorder.on_key_event(kind, call_id, func_name, time_ns)
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
