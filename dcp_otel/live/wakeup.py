"""The signal wakeup fd: dcp-otel's only while nobody else wants it.

A process has one wakeup fd (``signal.set_wakeup_fd``): the C-level handler of
every signal that has a Python handler writes the signal's number there at
once, even while the main thread is blocked in C (a gloo or NCCL wait), where
the Python handler runs only when the call returns. The watchdog reads it, so a
SIGTERM to a rank blocked in a C++ collective is seen at once. asyncio
(``loop.add_signal_handler``), trio and some applications use the same fd, and
one setter silently replaces the other. So dcp-otel holds it only while it is
free:

* :meth:`WakeupFd.install` (main thread) takes the fd where nobody holds it,
  and puts ``signal.set_wakeup_fd`` behind a function that does exactly what
  the interpreter's does for its caller, and tells dcp-otel what happened:
  - someone sets an fd: it is theirs from now on; dcp-otel steps aside
    (``on_change(False)``). Where ours was set, the call returns ``-1``: for its
    caller nobody held it (trio then sees no collision and gives ``-1`` back);
  - someone sets ``-1`` (gives theirs back, as asyncio does when its loop
    closes or its last signal handler goes): dcp-otel takes it again
    (``on_change(True)``), so a SIGTERM in a collective after ``asyncio.run()``
    is seen at once as before it.
* :meth:`WakeupFd.remove` gives back exactly what was there: ``-1`` where it was
  ours, nothing where it is someone's; and the interpreter's function, unless
  someone put their own over ours (ours then only passes calls through).

Python does not say with which ``warn_on_full_buffer`` a wakeup fd was set, so
an fd that someone set *before* ``install`` (dcp-otel has to set its own to
learn that one is there) is put back with that of the library known to hold it:
asyncio's default (``True``), trio's and uvloop's ``False``; ``True`` otherwise,
Python's default. Every fd set after ``install`` passes through unchanged.

Usage::

    wakeup = WakeupFd(writer.fileno(), on_change=lambda ours: ...)
    wakeup.install()        # main thread; True: ours now
    wakeup.owned            # whether the C-level handler writes to ours now
    wakeup.remove()
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any, Final

from dcp_otel.live.signal_exceptions import reraise_if_signalled

#: The interpreter's own function, whatever wraps ``signal.set_wakeup_fd`` later.
_REAL_SET_WAKEUP_FD: Final = signal.set_wakeup_fd


class WakeupFd:
    """One process's claim on the signal wakeup fd (see the module)."""

    def __init__(self, fd: int, on_change: Callable[[bool], None]) -> None:
        self._fd = fd
        self._on_change = on_change
        self.owned = False
        self.active = False
        self._replaced: Any = None  # the function ours stands in front of
        self._replacement: Callable[..., int] | None = None

    def install(self) -> bool:
        """Take the wakeup fd if it is free and watch who sets it from now on (main thread). True: ours."""
        self.active = True
        held = _REAL_SET_WAKEUP_FD(self._fd, warn_on_full_buffer=False)
        if held != -1:  # someone's: put back at once
            _REAL_SET_WAKEUP_FD(held, warn_on_full_buffer=_holder_warns(held))
        self.owned = held == -1
        if self._replacement is None:
            self._replaced = signal.set_wakeup_fd
            self._replacement = self._make_replacement(self._replaced)
            signal.set_wakeup_fd = self._replacement
        return self.owned

    def remove(self) -> None:
        """Give back what :meth:`install` took (main thread)."""
        self._give_back()
        if self._replacement is not None and signal.set_wakeup_fd is self._replacement:
            signal.set_wakeup_fd = self._replaced
            self._replacement = self._replaced = None

    def forget_after_fork(self) -> None:
        """A forked child: the parent's fd is not its own; ours only passes calls through from now on."""
        self._give_back()

    def _give_back(self) -> None:
        """Inert from now on; ``-1`` where the fd is ours (it was ``-1`` when we took it)."""
        self.active = False
        if self.owned:
            self.owned = False
            try:
                current = _REAL_SET_WAKEUP_FD(-1)
                if current not in (-1, self._fd):  # (never: whoever sets one goes through ours)
                    _REAL_SET_WAKEUP_FD(current)
            except (ValueError, OSError):
                pass

    def _make_replacement(self, replaced: Callable[..., int]) -> Callable[..., int]:
        def set_wakeup_fd(fd: int, /, *, warn_on_full_buffer: bool = True) -> int:
            previous = replaced(fd, warn_on_full_buffer=warn_on_full_buffer)  # raises as the interpreter's does
            if not self.active:
                return previous
            if previous == self._fd:
                previous = -1  # ours: for the caller, nobody held it
            if fd == -1:  # given back: ours again
                try:
                    _REAL_SET_WAKEUP_FD(self._fd, warn_on_full_buffer=False)
                    self.owned = True
                except (ValueError, OSError):  # (our socket closed under us): stay out of it
                    self.owned = False
            else:
                self.owned = False
            self._tell()
            return previous

        set_wakeup_fd.__doc__ = getattr(replaced, "__doc__", None)
        set_wakeup_fd.__wrapped__ = replaced  # type: ignore[attr-defined]
        return set_wakeup_fd

    def _tell(self) -> None:
        try:
            self._on_change(self.owned)
        except Exception as exc:  # noqa: BLE001 - the caller's set_wakeup_fd must behave as the interpreter's
            reraise_if_signalled(exc)


def _holder_warns(fd: int) -> bool:
    """The ``warn_on_full_buffer`` the known holders of a wakeup fd set it with (see the module)."""
    try:
        trio = sys.modules.get("trio")
        if trio is not None and trio.lowlevel.in_trio_run():
            return False  # trio: set_wakeup_fd(fd, warn_on_full_buffer=False)
    except Exception as exc:  # noqa: BLE001 - an old or odd trio: not trio's then
        reraise_if_signalled(exc)
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None:
        loop = asyncio._get_running_loop()
        if loop is not None:
            if type(loop).__module__.startswith("uvloop"):
                return False  # uvloop: warn_on_full_buffer=False
            csock = getattr(loop, "_csock", None)
            if csock is not None and csock.fileno() == fd:
                return True  # asyncio: set_wakeup_fd(self._csock.fileno())
    return True
