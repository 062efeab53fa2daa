"""Counted, rate-limited warnings about dcp-otel itself.

Telemetry must never raise into training code, and a broken backend must not
flood the training log. Every problem on the hot path goes through
:func:`report`: it is always counted (see :func:`dcp_otel.diagnostics`) and
logged at most once per reason per :data:`LOG_INTERVAL_S`.

Usage::

    from dcp_otel._selftelemetry import report

    report("malformed_event", "dropped a DCP log record without uuid: %r", msg)
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from dcp_otel import _forksafe
from dcp_otel.live.signal_exceptions import reraise_if_signalled

logger = logging.getLogger("dcp_otel")

#: Seconds between two log lines for the same reason (counts are kept regardless).
LOG_INTERVAL_S = 60.0
_lock = threading.RLock()
_counts: Counter[str] = Counter()
_last_logged: dict[str, float] = {}
#: Told the reason of every report: the checkpoint metrics count them for Prometheus.
_listeners: list[Callable[[str], None]] = []


def add_listener(listener: Callable[[str], None]) -> None:
    """Call ``listener(reason)`` on every report from now on (it must not block)."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str], None]) -> None:
    try:
        _listeners.remove(listener)
    except ValueError:
        pass


def report(reason: str, msg: str, *args: Any, exc_info: bool = False) -> None:
    """Count one occurrence of ``reason`` and log it unless logged recently.

    Never raises: this is what the hot path calls when something went wrong.
    """
    try:
        for listener in tuple(_listeners):
            try:
                listener(reason)
            except Exception as exc:  # noqa: BLE001 - counting a problem must not become one
                reraise_if_signalled(exc)
        now = time.monotonic()
        # ``with`` a C lock: taken and let go by the interpreter itself, so a signal handler's exception never
        # leaves it held (one raised right after an explicit acquire() would). Reentrant: a handler that runs
        # while this thread holds it (its exception's own report, a save in the handler) takes it again.
        with _lock:
            _counts[reason] += 1
            last = _last_logged.get(reason)
            if last is not None and now - last < LOG_INTERVAL_S:
                return
            _last_logged[reason] = now
            suppressed = _counts[reason] - 1
        if suppressed:
            msg += " (%d occurrences so far)"
            args = (*args, suppressed + 1)
        logger.warning(msg, *args, exc_info=exc_info)
    except Exception as exc:  # noqa: BLE001 - the last line of defence must not raise
        reraise_if_signalled(exc)


def counts() -> dict[str, int]:
    """A snapshot of how often each reason was reported in this process."""
    with _lock:
        return dict(_counts)


def _after_fork_in_child() -> None:
    """A forked child starts with its own counts, and a lock no parent thread holds."""
    global _lock
    _lock = threading.RLock()
    _counts.clear()
    _last_logged.clear()


def reset() -> None:
    """Forget all counts and rate limits (for tests and after ``fork``)."""
    with _lock:
        _counts.clear()
        _last_logged.clear()


_forksafe.register(sys.modules[__name__])
