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

While a state dict's conversion holds the per-key lane
(:mod:`dcp_otel.tracing.key_lane`), ``debug`` is that lane's reader (an
instance attribute over the method, gone when the lane is released): one
frame a record, doing what ``Logger.debug`` does in it too, so that a flat
10,000-key state dict's 20,000 records cost ~80 instructions a key above torch
alone instead of ~180.

Usage::

    tap = DCPLoggerTap(torch_module._dcp_logger, recorder)
    torch_module._dcp_logger = tap          # patches.install does this, and remove() undoes it
"""

from __future__ import annotations

import logging
import sys
from threading import get_ident as _get_ident
from types import CodeType
from typing import Any

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.events import MalformedEvent, parse_event
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.cut_short import PASSING, passes_records_along
from dcp_otel.tracing.key_lane import KeyLane
from dcp_otel.tracing.records import key_of
from dcp_otel.tracing.tracker import SpanRecorder

_KEY_PREFIX = semconv.STATEFUL_KEY_PREFIX
_KINDS = frozenset(("start", "end", "exception"))
_DEBUG = logging.DEBUG
_LOGGER_DEBUG = logging.Logger.debug
_LOGGER_IS_ENABLED_FOR = logging.Logger.isEnabledFor


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
        recorder.lane_watch = self

    def go_inert(self) -> None:
        """Feed nothing from now on, and pass every call on to torch's logger (left under another stand-in)."""
        self._fast = _fed_nothing
        if _reader_of(self.__dict__.get("debug")) is not None:
            del self.__dict__["debug"]

    def lane_opened(self, lane: KeyLane) -> None:
        """A conversion opened ``lane``: its records are read by a reader of its own (see :func:`_lane_reader`)
        until it is released, where torch's logger is a plain ``Logger``."""
        logger = self.logger
        if self._fast is _fed_nothing or not _plain_logger(logger):
            return  # (inert; a logger of its own kind: the general way, where its debug is called)
        standing = self.__dict__.get("debug")
        if standing is not None and _reader_of(standing) is None:
            return  # someone's own wrapper of the tap's debug (a counting one, say): left as it is, the method's way
        self.debug = _lane_reader(self, lane)  # type: ignore[method-assign]

    def lane_released(self, lane: KeyLane) -> None:
        """``lane`` is free: its reader, if it stands as ``debug``, gives way to the method."""
        if _reader_of(self.__dict__.get("debug")) is lane:  # (not another lane's, nor a wrapper put over it since)
            del self.__dict__["debug"]

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
            # This frame counts as logging's own too: the call passes as torch made it (a stand-in's error of its
            # own, with no stacklevel to take, a mock's, get what they would without the tap).
            self.logger.error(msg, *args, **kwargs)
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


def _lane_reader(tap: DCPLoggerTap, lane: KeyLane) -> Any:
    """The tap's ``debug`` while ``lane`` is open: that thread's per-key records read in one frame, with what
    the method would look up for every record already at hand (the lane's parts, the logger, the method).

    A flat 10,000-key state dict logs 20,000 records on the caller's thread (and as many again on the upload
    thread of an ``async_save``): through the method, a key cost 180 Python instructions more than torch
    alone, 5.5% of that save's (``benchmarks/own_share.py``); this reader does the same work with ~80. Whatever
    it does not take (another thread's record, a call inside a key, anything the method treats apart) it hands
    to the method, which reads the lane the general way. Torch's logger is known to be a plain ``Logger`` (the
    tap reads that when the lane opens); its level is asked for every record, as ``Logger.debug`` asks it, and at
    every key's end whether its ``debug`` and ``isEnabledFor`` are still logging's (set on it, on its class, or its
    class changed, by the key's own ``state_dict``: the method reads every record from then on, as exactly as
    without the tap). A change that no key's conversion makes (another thread's, a handler's of a key's end) is
    seen at the next key's end, one record late (asked at every record, it would cost as much again: 10 a key).
    """
    thread, stack, call, stats = lane.thread, lane.stack, lane.call, lane.stats
    logger: Any = tap.logger  # (a plain Logger: its level cache is read as isEnabledFor reads it)
    method = DCPLoggerTap.debug
    own_debug, own_enabled = logger.debug, logger.isEnabledFor  # (logging's: the lane opens only for a plain Logger)

    def dcp_otel_logger_tap_debug(msg: Any, *args: Any, **kwargs: Any) -> None:
        other: Any  # (what the method is handed: the record the reader did not take)
        try:
            try:
                # The order is the cost's: a key's end is known by its dict alone (held: the lane's thread's own
                # record), a start needs the thread and its name.
                if msg is lane.held and stack[-1] is call and msg["event"] == "end":  # the open key's end: torch
                    # ends a call with the dict it began it with. The logger still plain? What the key's own
                    # conversion (a state_dict) did to it, a debug or an isEnabledFor set on it or on its class, is
                    # honoured from this record on: the method's way (see the except).
                    if logger.debug != own_debug or logger.isEnabledFor != own_enabled:  # (bound methods: equal
                        raise LookupError("torch's logger changed")  # while the same function of the same logger)
                    took = msg["times_spent"]  # its end less its start
                    if took < 0:  # (the wall clock stepped back meanwhile; not a number: TypeError)
                        took = 0
                    lane.held = None
                    stats.count += 1
                    stats.total_ns += took
                    if took >= stats.floor:
                        stats.slow(took, msg["func_name"])
                elif lane.held is not None or _get_ident() != thread or msg["event"] != "start" \
                        or not msg["func_name"].startswith(_KEY_PREFIX):  # fmt: skip
                    msg, other = None, msg  # the method's (below): nothing of the lane's was touched
                else:  # a key's start (not asked whether the conversion is the innermost call: a key's start comes
                    # only then, nothing held; whatever a cut-short call left above it is closed at the key's end)
                    lane.start_ns = msg["time"]  # (the method's, should the key's end come its way)
                    lane.held = msg
            except Exception as exc:  # noqa: BLE001 - not the lane's (no dict, a field missing): the method's
                reraise_if_signalled(exc)
                other = msg
                if not _plain_logger(logger):  # changed: the method reads every record from here on
                    tap.lane_released(lane)
            else:
                if msg is not None:  # taken: logged as Logger.debug would, its isEnabledFor done here too
                    if not logger.disabled:
                        try:
                            enabled = logger._cache[_DEBUG]
                        except KeyError:
                            enabled = logger.isEnabledFor(_DEBUG)
                        if enabled:
                            logger._log(_DEBUG, msg, args, **kwargs)
                    return
        except BaseException:
            if msg is not None:
                tap.cut_short(msg)  # (what the method does: a key's start undone, or the recorder makes whole)
            raise
        method(tap, other, *args, **kwargs)  # everything else (it makes whole what it is cut short in itself)

    dcp_otel_logger_tap_debug.__code__ = _READER_CODE  # (the same code for every lane: passes_records_along's)
    dcp_otel_logger_tap_debug.lane = lane  # type: ignore[attr-defined]  # (whose it is: _reader_of)
    return dcp_otel_logger_tap_debug


def _reader_of(debug: Any) -> KeyLane | None:
    """The lane ``debug`` (what stands as the tap's ``debug``) is the reader of; ``None``: not a lane's reader."""
    if getattr(debug, "__code__", None) is _READER_CODE:
        return debug.lane  # type: ignore[no-any-return]
    return None


def _plain_logger(logger: Any) -> bool:
    """Whether ``logger`` is a ``logging.Logger`` whose ``debug`` and ``isEnabledFor`` are logging's own, with
    the level cache they read (the lane reader does what they do, in its own frame)."""
    own = getattr(logger, "__dict__", None)
    return type(own) is dict and type(own.get("_cache")) is dict and "disabled" in own \
        and type(logger).debug is _LOGGER_DEBUG and type(logger).isEnabledFor is _LOGGER_IS_ENABLED_FOR \
        and "debug" not in own and "isEnabledFor" not in own and "_log" not in own  # fmt: skip


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


def _as_loggings_own(method: Any, name: str = "dcp_otel_logger_tap_debug") -> None:
    """Make ``method``'s frame one that ``logging`` skips when it looks for the line that logged (its code named
    ``name``).

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
    method.__code__ = _loggings_own(method.__code__, name)


def _loggings_own(code: CodeType, name: str = "dcp_otel_logger_tap_debug") -> CodeType:
    srcfile = getattr(logging, "_srcfile", None)  # None: this Python's logging finds no caller at all
    if isinstance(srcfile, str) and srcfile:
        return code.replace(co_filename=srcfile, co_name=name)
    return code


_as_loggings_own(DCPLoggerTap.debug)
_as_loggings_own(DCPLoggerTap.error, "dcp_otel_logger_tap_error")
#: The lane reader's code, once, under logging's file name (every lane's reader is a closure of it).
_READER_CODE: CodeType = _loggings_own(next(c for c in _lane_reader.__code__.co_consts if isinstance(c, CodeType)))
passes_records_along(DCPLoggerTap.debug, DCPLoggerTap.error, DCPLoggerTap.feed, DCPLoggerTap._general, _ended_in_a_copy,
                     _lane_failed)
PASSING.add(_READER_CODE)
