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
import functools
import signal
import threading
from types import CodeType
from typing import Any, Final

_SIGNALS: Final = tuple(sorted(signal.valid_signals()))  # 200 us to build: once


def reraise_if_signalled(exc: BaseException) -> None:
    """Raise ``exc`` again if a signal handler raised it (call it first in an ``except Exception`` clause)."""
    if raised_by_signal_handler(exc):
        raise exc


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a Python signal handler that ran inside the ``try`` that caught it.

    The handler's frame is pushed on top of the frame it interrupted, so it is
    in the traceback between the catching frame (left out: a handler may catch
    its own errors) and where ``exc`` was raised.
    """
    if threading.current_thread() is not threading.main_thread():
        return False  # Python runs signal handlers on the main thread only
    traceback = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    if traceback is None:
        return False
    handlers = _handler_codes()
    while traceback is not None:
        if traceback.tb_frame.f_code in handlers:
            return True
        traceback = traceback.tb_next
    return False


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
