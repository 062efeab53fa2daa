"""A wake-up that any thread gives with one call into C, and one thread waits for.

``threading.Event.set`` takes its condition's lock and releases it in Python (``Condition.__exit__``): a signal
handler's exception raised between the two (the training thread is where Python runs handlers) leaves that lock
held for good, and the next ``set`` or ``wait`` on it blocks forever. dcp-otel wakes its threads from the
training thread (a checkpoint call's end, a training step's end), so it uses this instead: a plain lock held
while no wake is pending; ``set`` releases it (one C call: an exception before or after it leaves nothing held),
``wait`` acquires it with a timeout, which takes the wake.

Usage::

    wake = Wake()
    wake.set()                      # any thread, any time; a wake already pending stays one
    wake.clear()                    # the waiter: forget a pending wake, then look at what it waits for
    woken = wake.wait(0.5)          # the waiter: True if woken (the wake is taken), False past the timeout
    wake.is_set()                   # or, never waited for, a flag (the builder's hurry): set until cleared
"""

from __future__ import annotations

import threading


class Wake:
    """A pending wake-up: set from any thread (signal-safe), waited for by one (see the module)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held: no wake pending

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # released already: a wake is pending
            pass

    def clear(self) -> None:
        self._lock.acquire(blocking=False)

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=max(0.0, timeout))

    def is_set(self) -> bool:
        """Whether a wake is pending (read without taking it)."""
        return not self._lock.locked()
