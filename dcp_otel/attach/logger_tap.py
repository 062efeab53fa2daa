"""The stand-in for torch's DCP logger: every DCP record reaches dcp-otel first.

torch's ``_dcp_method_logger`` logs a start, an end and (for some functions) an
exception record for every DCP call, synchronously, on the calling thread,
through the module global ``torch.distributed.checkpoint.logger._dcp_logger``.
:class:`DCPLoggerTap` takes that global's place: it hands each record's dict to a
:class:`~dcp_otel.tracing.tracker.SpanRecorder`, then passes the call on to
torch's logger unchanged, so the logger's own handlers see exactly what they
saw before.

Why not a ``logging.Handler`` on that logger: the application's logging
configuration decides whether handlers are called. ``logging.config.dictConfig``
or ``fileConfig`` (``disable_existing_loggers=True``, their default) disables
every logger that exists when it runs, torch's included, and
``logging.disable(INFO)`` silences every logger below WARNING; a handler then
receives nothing, and every checkpoint vanishes from traces and metrics
without a word. The tap does not depend on the logging configuration at all,
and skips the ``LogRecord`` a handler would need.

Usage::

    tap = DCPLoggerTap(torch_module._dcp_logger, recorder)
    torch_module._dcp_logger = tap          # patches.install does this, and remove() undoes it
"""

from __future__ import annotations

import logging
import sys
from threading import get_ident as _get_ident
from typing import Any

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.events import MalformedEvent, parse_event
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.cut_short import passes_records_along
from dcp_otel.tracing.key_lane import KeyLane
from dcp_otel.tracing.records import key_of
from dcp_otel.tracing.tracker import SpanRecorder

_KEY_PREFIX = semconv.STATEFUL_KEY_PREFIX
_KINDS = frozenset(("start", "end", "exception"))
_DEBUG = logging.DEBUG
_LOGGER_DEBUG = logging.Logger.debug


class DCPLoggerTap:
    """Feeds DCP's records to a recorder, then logs them as torch would; never raises into DCP.

    Everything but the logging methods is the wrapped logger's own (``handlers``,
    ``level``, ``addHandler``, ...), so code that configures torch's logger
    through the module global still configures the real one.
    """

    def __init__(self, logger: logging.Logger, recorder: SpanRecorder) -> None:
        self.logger = logger
        self.recorder = recorder
        self._fast = recorder.on_record

    def go_inert(self) -> None:
        """Feed nothing from now on, and pass every call on to torch's logger (left under another stand-in)."""
        self._fast = _fed_nothing

    def __getattr__(self, name: str) -> Any:
        if name in ("logger", "recorder", "_fast"):  # not set yet (a copy being built): never recurse
            raise AttributeError(name)
        return getattr(self.logger, name)

    def __repr__(self) -> str:
        return f"<DCPLoggerTap of {self.logger!r}>"

    # torch calls exactly these two: debug (start, end) and error (exception). Any other
    # method is the logger's own (``__getattr__``), as for code that is not DCP's.
    #
    # What comes out of one (a signal handler's exception, raised wherever the main thread is) goes on to
    # torch's code, and the record's handling is made whole first: see dcp_otel.tracing.cut_short.
    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        try:
            lane = self.recorder.lane
            taken = False
            if lane is not None and lane.thread == _get_ident():
                # A state dict's per-key records (two a key), while their conversion holds the lane
                # (dcp_otel.tracing.key_lane): read here, nothing else of dcp-otel runs per key.
                try:
                    held: Any = lane.held
                    if msg is held:  # the open key's end: torch ends a call with the dict it began it with
                        took = msg["time"] - lane.start_ns
                        if msg["event"] == "end":
                            if took < 0:  # (the wall clock stepped back meanwhile)
                                took = 0
                            if lane.stack[-1] is not lane.call:  # a call inside the key left open (cut short)
                                _close_above_the_conversion(self.recorder, lane, msg)
                            lane.held = None
                            stats = lane.stats  # (KeyStats.add, in this frame)
                            stats.count += 1
                            stats.total_ns += took
                            if took >= stats.floor:
                                stats.slow(took, msg["func_name"])
                            taken = True
                    elif held is None and lane.stack[-1] is lane.call:  # (not while a call inside it runs)
                        if msg["event"] == "start" and msg["func_name"].startswith(_KEY_PREFIX):
                            start = msg["time"]
                            if start > 0:  # (not a number: TypeError, the general way)
                                lane.start_ns = start
                                lane.held = msg
                                taken = True
                    else:
                        taken = _ended_in_a_copy(self.recorder, lane, msg)
                except Exception as exc:  # noqa: BLE001 - not the lane's (no dict, a field missing): the general way
                    reraise_if_signalled(exc)
                    taken = False
            if not taken and not self._fast(msg):  # a step's two records take the recorder's hot path, in one call
                self._general(msg)
            logger = self.logger
            # This frame counts as logging's own (_as_loggings_own): the caller's stack level passes unchanged.
            # (The class first: any Logger has a __dict__, a stand-in of another kind may not.)
            if type(logger).debug is not _LOGGER_DEBUG or "debug" in logger.__dict__:  # a logger of its own kind
                logger.debug(msg, *args, **kwargs)
            elif logger.isEnabledFor(_DEBUG):  # what Logger.debug does, one frame fewer
                logger._log(_DEBUG, msg, args, **kwargs)
        except BaseException:
            self.cut_short(msg)
            raise

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        try:
            lane = self.recorder.lane
            if lane is None or lane.thread != _get_ident() or not _lane_failed(self.recorder, lane, msg):
                self.feed(msg)  # (not a hot path: debug inlines feed, error need not)
            self.logger.error(msg, *args, stacklevel=kwargs.pop("stacklevel", 1) + 1, **kwargs)
        except BaseException:
            self.cut_short(msg)
            raise

    def feed(self, msg: Any) -> None:
        """Hand one DCP record (torch's dict) to the recorder."""
        # The two records of every DCP step (and of every key of a state dict) go straight to the hot path;
        # everything else (operations, exceptions, malformed records) takes the general one.
        try:
            if not self._fast(msg):
                self._general(msg)
        except BaseException:
            self.cut_short(msg)
            raise

    def cut_short(self, msg: Any) -> None:
        """Handing ``msg`` on was cut short by an exception: the recorder makes whole what it left."""
        lane = self.recorder.lane
        if lane is not None and lane.thread == _get_ident() and _of_the_open_key(lane, msg):
            lane.held = None  # a key's start undone, or its end dropped (its time is lost, nothing is left open)
            return
        if self._fast is not _fed_nothing:
            self.recorder.cut_short(msg)

    def _general(self, msg: Any) -> None:
        try:
            if type(msg) is dict:  # a 10,000-key state dict logs 20,000 per-key records: no event object
                kind, call_id, func_name, time_ns = msg.get("event"), msg.get("uuid"), msg.get("func_name"), msg.get("time")
                if type(call_id) is str and type(func_name) is str and type(time_ns) is int and call_id and time_ns > 0 \
                        and func_name.startswith(_KEY_PREFIX) and kind in _KINDS:  # fmt: skip
                    self.recorder.on_key_event(kind, call_id, func_name, time_ns)
                    return
            event = parse_event(msg)
        except MalformedEvent as exc:
            report("malformed_event", "dropped a DCP log record: %s", exc)
            return
        except Exception as exc:  # noqa: BLE001 - telemetry never raises into training
            reraise_if_signalled(exc)
            report("handler_error", "dcp_otel failed to read a DCP log record", exc_info=True)
            return
        # torch logs an exception from inside its ``except`` block: the
        # exception object (type, traceback) is the one being handled now.
        exc_value = sys.exc_info()[1] if event.kind == "exception" else None
        self.recorder.on_event(event, exc_value)


def _of_the_open_key(lane: KeyLane, msg: Any) -> bool:
    """Whether ``msg`` is a record of the key open in the lane: torch's own dict, or a copy with its uuid."""
    held = lane.held
    if held is None:
        return False
    if msg is held:
        return True
    uuid = msg.get("uuid") if type(msg) is dict else None
    return type(uuid) is str and uuid == held.get("uuid") and msg.get("func_name") == held.get("func_name")


def _ended_in_a_copy(recorder: SpanRecorder, lane: KeyLane, msg: Any) -> bool:
    """The open key's end in another dict than its start's (not torch's way; a test's, a replay's): taken."""
    time_ns = msg.get("time") if type(msg) is dict else None
    if type(time_ns) is not int:
        return False
    start_ns = lane.start_ns
    if not _closed_the_open_key(recorder, lane, msg, "end"):
        return False
    lane.stats.add(msg["func_name"], max(0, time_ns - start_ns))
    return True


def _lane_failed(recorder: SpanRecorder, lane: KeyLane, msg: Any) -> bool:
    """Whether ``msg`` is the open key's exception (then named on its conversion, the key closed)."""
    if not _closed_the_open_key(recorder, lane, msg, "exception"):
        return False
    lane.stats.failed_key = key_of(msg["func_name"])
    return True


def _closed_the_open_key(recorder: SpanRecorder, lane: KeyLane, msg: Any, kind: str) -> bool:
    """Whether ``msg`` is the open key's record of ``kind`` (then the key is closed, and what it left open)."""
    if not _of_the_open_key(lane, msg) or msg.get("event") != kind:
        return False
    _close_above_the_conversion(recorder, lane, msg)
    lane.held = None
    return True


def _close_above_the_conversion(recorder: SpanRecorder, lane: KeyLane, msg: dict[str, Any]) -> None:
    """The open key's end or exception came with calls of that key still open above its conversion (an end cut
    short by a signal handler's exception): ended here, failed, as the general path ends them."""
    stack = lane.stack
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is lane.call:
            if index < len(stack) - 1:
                time_ns = msg.get("time")
                recorder._close_above(stack, index, time_ns if type(time_ns) is int else 0,
                                      f"the conversion of {key_of(str(msg.get('func_name')))!r} ended")  # fmt: skip
            return


def _fed_nothing(msg: Any) -> bool:
    return True  # "taken": the general path is not tried either


def _as_loggings_own(method: Any) -> None:
    """Make ``method``'s frame one that ``logging`` skips when it looks for the line that logged.

    A record names the line that logged it (``%(filename)s:%(lineno)s``): ``Logger.findCaller`` walks up the
    stack past logging's own frames, known by their file name. The tap's ``debug`` stands where
    ``Logger.debug`` stood, and under logging's file name the walk passes it as it passed ``Logger.debug``:
    torch's records name torch's line, and the walk is as long as without dcp-otel (passing
    ``stacklevel=2`` made it walk one frame more per record: 44 bytecode instructions and a call of
    ``os.path.normcase``; ``overhead.step_cost``'s step fell from 7.0-7.8 to 3.6-3.7 µs without it).
    Only the code's file name and name change, and the name says whose it is: a profile or a traceback
    through it shows ``logging/__init__.py`` (this file's line numbers) in ``dcp_otel_logger_tap_debug``
    (it raises nothing of its own: the recorder never raises).
    """
    srcfile = getattr(logging, "_srcfile", None)  # None: this Python's logging finds no caller at all
    if isinstance(srcfile, str) and srcfile:
        method.__code__ = method.__code__.replace(co_filename=srcfile, co_name="dcp_otel_logger_tap_debug")


_as_loggings_own(DCPLoggerTap.debug)
passes_records_along(DCPLoggerTap.debug, DCPLoggerTap.error, DCPLoggerTap.feed, DCPLoggerTap._general, _ended_in_a_copy,
                     _lane_failed)
