"""Fresh dcp-otel state in a forked child (DataLoader workers, ``os.fork``).

``fork`` copies the parent's memory but only the forking thread: a lock that
another thread held at that moment stays locked forever in the child, and
spans, uploads and counters in flight in the parent would be ended or reported
a second time by the child. Every object holding such state registers here and
gets its ``_after_fork_in_child()`` called in the child, before anything else
runs there (the same pattern as the OpenTelemetry SDK's span processors).

Usage::

    class Recorder:
        def __init__(self) -> None:
            self._lock = threading.Lock()
            _forksafe.register(self)

        def _after_fork_in_child(self) -> None:
            self._lock = threading.Lock()
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

from dcp_otel.live.signal_exceptions import reraise_if_signalled


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def register(obj: ForkAware) -> None:
    """Reset ``obj`` in every child forked from now on, for as long as it lives."""
    _objects.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_objects):
        try:
            obj._after_fork_in_child()
        except Exception as exc:  # noqa: BLE001 - a fork must never fail because of telemetry
            reraise_if_signalled(exc)


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
