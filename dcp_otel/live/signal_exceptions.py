"""An exception a signal handler raised is the application's: our ``except Exception`` lets it through.

A Python signal handler runs on the main thread between two bytecodes of
whatever runs there, and what it raises comes out of that code. torchelastic's
agent turns the scheduler's SIGTERM into ``SignalException`` (an ``Exception``)
that way, and the agent's main loop calls :class:`~dcp_otel.OTelMetricHandler`
ten times a second: a telemetry ``except Exception`` that caught it would leave
the agent running, its workers untouched, the job not ended. So every such
clause that can run on an application's thread asks first::

    try:
        record(call)
    except Exception as exc:  # noqa: BLE001 - telemetry never raises into training
        reraise_if_signalled(exc)
        report("recorder_error", "dcp_otel failed to record a call", exc_info=True)

A ``KeyboardInterrupt`` (SIGINT's default) or ``SystemExit`` is no ``Exception``
and never needed this.
"""

from __future__ import annotations

import _signal  # the C module signal wraps: its getsignal gives SIG_DFL as a plain int, 20 times faster
import _thread
import functools
import signal
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Final, TypeVar

T = TypeVar("T")
_SIGNALS: Final = tuple(sorted(signal.valid_signals()))  # 200 us to build: once
_VALID: Final = frozenset(_SIGNALS)


def reraise_if_signalled(exc: BaseException) -> None:
    """Raise ``exc`` again if a signal handler raised it (call it first in an ``except Exception`` clause)."""
    if raised_by_signal_handler(exc):
        raise exc


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a Python signal handler that ran inside the ``try`` that caught it.

    The handler's frame is pushed on top of the frame it interrupted, so it is
    in the traceback between the catching frame (left out as a handler: a
    handler may catch its own errors) and where ``exc`` was raised. It is told
    two ways, either one enough:

    * by what the interpreter called it with: ``(signum, frame)``, where
      ``frame`` is the very frame below it in the traceback (its caller). No
      other call gets its caller's frame right after a signal number: this
      holds for a one-shot handler (one that restores the previous disposition
      before it raises, and is no longer installed when the ``except`` looks),
      for a handler wrapped by a decorator (``*args``), a method, a
      ``functools.partial``;
    * by its code: that of a handler installed now (one that dropped its
      arguments before raising).

    A handler written in C (a compiled extension's) has no Python frame: what
    it raises is not told from an error of ours.
    """
    if threading.current_thread() is not threading.main_thread():
        return False  # Python runs signal handlers on the main thread only
    below = exc.__traceback__
    traceback = below.tb_next if below is not None else None
    if below is None or traceback is None:
        return False
    handlers: set[CodeType] | None = None
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_back is below.tb_frame and _called_with_its_caller(frame):
            return True
        if handlers is None:
            handlers = _handler_codes()
        if frame.f_code in handlers:
            return True
        below, traceback = traceback, traceback.tb_next
    return False


def _called_with_its_caller(frame: FrameType) -> bool:
    """Whether ``frame``'s arguments hold a signal number followed by ``frame``'s caller: a handler's call."""
    caller = frame.f_back
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & _VARARGS)]
    local = frame.f_locals
    values: list[Any] = []
    for name in names:
        value = local.get(name)
        values.extend(value) if isinstance(value, tuple) else values.append(value)
    return any(value is caller and _is_signal(values[i - 1]) for i, value in enumerate(values) if i)


def _is_signal(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in _VALID


_VARARGS: Final = 0x04  # inspect.CO_VARARGS


def _handler_codes() -> set[CodeType]:
    """The code of every Python-level signal handler installed now (read on each call: handlers change)."""
    codes = set()
    for signum in _SIGNALS:
        try:
            code = _code_of(_signal.getsignal(signum))
        except (ValueError, OSError):
            continue
        if code is not None:
            codes.add(code)
    return codes


def _code_of(handler: Any, depth: int = 0) -> CodeType | None:
    """The code a handler runs: a function, a bound method, a ``functools.partial``, a callable object."""
    if handler is None or isinstance(handler, int) or depth > 3:  # SIG_DFL, SIG_IGN, None (set from C)
        return None
    code = getattr(handler, "__code__", None)
    if isinstance(code, CodeType):
        return code
    if isinstance(handler, functools.partial):
        return _code_of(handler.func, depth + 1)
    function = getattr(handler, "__func__", None)  # a bound method
    if function is not None:
        return _code_of(function, depth + 1)
    if isinstance(handler, type) or not callable(handler):
        return None
    return _code_of(type(handler).__call__, depth + 1)  # an object with a __call__ of its own


#: ``start_elsewhere((thread,))``: ``thread.start()``, run on a bare helper thread. Python's own ``start()`` cut
#: short by a signal handler's exception (on the main thread) leaves the new thread failing in Python's
#: bookkeeping, and saying so on stderr ("Exception ignored in thread started by ..."); on the helper no handler
#: runs. A ``partial`` of C functions: no Python frame on the caller's side, so an exception can come out of it
#: only once the helper is launched, and the thread will start. Set what says the thread runs before calling it.
start_elsewhere: Final = functools.partial(_thread.start_new_thread, threading.Thread.start)


def join_started(thread: threading.Thread, timeout_s: float) -> None:
    """``thread.join(timeout_s)`` once its helper (:data:`start_elsewhere`) has started it (it may not have yet)."""
    deadline = time.monotonic() + timeout_s
    while thread.ident is None and time.monotonic() < deadline:
        time.sleep(0.001)  # (a helper that has not run yet: a few microseconds, once per process at most)
    if thread.ident is not None:
        thread.join(max(0.0, deadline - time.monotonic()))


def away_from_signals(fn: Callable[[], T]) -> T:
    """``fn()``, run where no signal handler runs when called on the main thread (a helper thread, waited for).

    Structure before inspection: dcp-otel calls libraries that have broad ``except`` clauses of their own (the
    OpenTelemetry SDK's ``get_tracer`` catches anything its tracer configurator raises). A handler's exception
    raised inside them, on the main thread, would be theirs to swallow; on another thread no handler runs, and a
    signal that comes meanwhile interrupts the wait here, in dcp-otel's code, where it passes through.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn()
    outcome: list[tuple[bool, Any]] = []
    finished = _thread.allocate_lock()
    finished.acquire()

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it was
            outcome.append((False, exc))
        finally:
            finished.release()

    # A bare thread (not threading.Thread): a signal handler's exception cutting threading's start() short
    # makes the new thread fail in Python's own bookkeeping, and print so; this one just runs out.
    _thread.start_new_thread(run, ())
    finished.acquire()
    done, value = outcome[0]
    if done:
        return value  # type: ignore[no-any-return]
    raise value
