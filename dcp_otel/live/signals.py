"""SIGTERM and SIGINT: the spans of the open DCP calls survive, then the signal acts as it would have.

Schedulers stop a job with SIGTERM (torchrun passes it to its workers' process
groups, which include their checkpoint processes; SLURM and Kubernetes do the
same), and SIGTERM's default action ends a process without ``atexit`` or
``finally``: a hung checkpoint left no span, and every finished span still in a
batch processor was lost. :meth:`SignalGuard.install` (at ``instrument()``, on
the main thread) installs a handler for SIGTERM and SIGINT **only where the
disposition is still the default** (``SIG_DFL``; for SIGINT, Python's
``default_int_handler``). A handler the application installed stays in charge:
it is left alone, and so is an ignored signal. On the signal, the handler:

1. ends every open DCP call as failed ("terminated by SIGTERM during
   write_data", with the stack) and builds and flushes spans and metrics,
   within ``flush_timeout_s`` (:class:`~dcp_otel.live.ending.Ending`);
2. restores the previous disposition and re-raises, so the process ends exactly
   as it would have: killed by the same signal (the same exit status, the same
   error report from torchrun), or, for SIGINT, ``KeyboardInterrupt``.

A Python handler runs only on the main thread, between bytecodes: a rank
blocked in a C++ collective (every rank waiting for one that hangs) would run
it only when the collective returns, long after torchrun's SIGKILL. So the
guard also takes the wakeup fd (``signal.set_wakeup_fd``, when nobody else has
it, e.g. an asyncio loop): the C-level handler writes the signal number there at
once, and the watchdog thread, reading it, does step 1 and then ends the
process with the default action itself. For a signal whose handler is not ours
(the application's), the watchdog only flushes what has finished.

``DCP_OTEL_SIGNALS=off`` (``instrument(signals=False)``) installs nothing.
Forked children get the previous dispositions back.

Usage::

    guard = SignalGuard(ending, flush_only)
    guard.install()                 # main thread; returns the signals taken
    guard.wakeup                    # the socket the watchdog reads signal numbers from
    guard.remove()
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report

logger = logging.getLogger("dcp_otel")

SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
#: How long the watchdog lets a re-raised signal act before it exits by itself.
_DEATH_GRACE_S: Final = 1.0
#: How long the watchdog leaves a SIGINT to the main thread's handler before it takes it as blocked.
_MAIN_GRACE_S: Final = 0.5
#: Guards removed off the main thread: their wakeup fd is still the process's, so their sockets stay open.
_UNRELEASED: list[SignalGuard] = []


def is_default(signum: int, handler: Any) -> bool:
    """Whether ``handler`` is the disposition a Python process starts with for ``signum``."""
    return handler is signal.SIG_DFL or (signum == signal.SIGINT and handler is signal.default_int_handler)


class SignalGuard:
    """One process's SIGTERM/SIGINT handlers and wakeup fd (see the module)."""

    def __init__(self, end: Callable[[str, FrameType | None], None], flush_only: Callable[[], object]) -> None:
        self._end = end  # ends the open calls (the interrupted frame, when known) and flushes, bounded
        self._flush_only = flush_only
        self._previous: dict[int, Any] = {}  # signum -> the disposition ours replaced
        self._lock = threading.RLock()  # a second signal may arrive while the main thread handles the first
        self._handled = threading.Condition(self._lock)
        # Per signal: deliveries the main thread's handler ran for, deliveries the watchdog read from the
        # wakeup fd, and those the watchdog already ended the calls for (its main-thread handler must not again).
        self._main_runs: dict[int, int] = {}
        self._woken: dict[int, int] = {}
        self._ended_ahead: dict[int, int] = {}
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._wakeup_taken = False
        self.active = False
        _forksafe.register(self)

    @property
    def wakeup(self) -> socket.socket:
        """Where signal numbers arrive (and a 0 byte from :meth:`poke`); read it without blocking."""
        return self._reader

    @property
    def installed(self) -> list[int]:
        """The signals whose handler is ours now."""
        return [sig for sig in self._previous if signal.getsignal(sig) == self._handle]

    def install(self) -> list[int]:
        """Take SIGTERM and SIGINT where they have their default disposition; main thread only.

        Returns the signals taken (``[]`` off the main thread).
        """
        if threading.current_thread() is not threading.main_thread():
            logger.info("dcp_otel: instrumented off the main thread: SIGTERM/SIGINT are left alone")
            return []
        self.active = True
        try:
            for sig in SIGNALS:
                current = signal.getsignal(sig)
                if is_default(sig, current):
                    signal.signal(sig, self._handle)
                    self._previous[sig] = current
        except (ValueError, OSError):  # an interpreter that will not let us: instrument() goes on without
            report("signal_setup_error", "dcp_otel could not install its SIGTERM/SIGINT handler", exc_info=True)
        try:
            held = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
            if held != -1:  # someone's already (an asyncio loop): theirs, not ours
                signal.set_wakeup_fd(held)
            else:
                self._wakeup_taken = True
        except (ValueError, OSError):
            report("signal_setup_error", "dcp_otel could not watch for signals off the main thread", exc_info=True)
        return list(self._previous)

    def remove(self) -> None:
        """Give back what :meth:`install` took (on the main thread; elsewhere the handlers only go inert)."""
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            if self._wakeup_taken:  # still registered: its socket must never close (the fd could be reused)
                _UNRELEASED.append(self)
            return
        for sig, previous in list(self._previous.items()):
            if signal.getsignal(sig) == self._handle:  # not if someone replaced ours since
                signal.signal(sig, previous)
            del self._previous[sig]
        if self._wakeup_taken:
            current = signal.set_wakeup_fd(-1)
            if current != self._writer.fileno():
                signal.set_wakeup_fd(current)  # someone took it since: theirs
            self._wakeup_taken = False

    def close(self) -> None:
        """Close the socket pair, once the wakeup fd is given back and its reader has stopped."""
        if self._wakeup_taken or self in _UNRELEASED:
            return
        self._reader.close()
        self._writer.close()

    def poke(self) -> None:
        """Wake the reader of :attr:`wakeup` (a 0 byte: no signal)."""
        try:
            self._writer.send(b"\0")
        except OSError:  # full: it will wake anyway
            pass

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) handles signals as it would without dcp-otel."""
        self.active = False
        self._lock = threading.RLock()  # (the parent's may have been held by a thread the child does not have)
        self._handled = threading.Condition(self._lock)
        self._main_runs, self._woken, self._ended_ahead = {}, {}, {}
        try:
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous)
            if self._wakeup_taken:
                current = signal.set_wakeup_fd(-1)
                if current not in (-1, self._writer.fileno()):
                    signal.set_wakeup_fd(current)
        except (ValueError, OSError):
            pass
        self._previous, self._wakeup_taken = {}, False
        # The parent's socket pair stays the parent's: the child's signals must never reach its watchdog.
        self._reader.close()
        self._writer.close()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    # --- the signal ---------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Our handler (main thread): end the open calls and flush, then the previous disposition acts."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        with self._handled:
            self._main_runs[signum] = self._main_runs.get(signum, 0) + 1
            self._handled.notify_all()
            ahead = self._ended_ahead.get(signum, 0)
            if ahead:  # the watchdog did it while this thread was blocked (in a collective)
                self._ended_ahead[signum] = ahead - 1
            elif self.active:
                self._end(signal.Signals(signum).name, frame)
        self._previous.pop(signum, None)
        signal.signal(signum, previous)
        if previous is signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action, now: the process ends as it would have
        elif callable(previous):
            previous(signum, frame)  # default_int_handler: KeyboardInterrupt

    def on_wakeup(self, signum: int) -> None:
        """The watchdog read ``signum`` from the wakeup fd: the main thread may be blocked for good."""
        if signum not in SIGNALS:
            return
        if not self.active or signal.getsignal(signum) != self._handle:
            self._flush_only()  # the application's handler decides; what finished is out meanwhile
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous is signal.SIG_DFL:  # the process ends now, whoever gets there first
            with self._lock:
                self._end(signal.Signals(signum).name, None)
            self._die(signum)
        # SIGINT: the process goes on, with the main thread raising KeyboardInterrupt when it next runs Python.
        # The calls end once, when it is inside them: by its handler if it runs in time (the interpreter
        # checks for signals between bytecodes), by this thread if it is blocked in C.
        with self._handled:
            delivery = self._woken[signum] = self._woken.get(signum, 0) + 1
            if self._handled.wait_for(lambda: self._main_runs.get(signum, 0) >= delivery, _MAIN_GRACE_S):
                return
            self._end(signal.Signals(signum).name, None)
            self._ended_ahead[signum] = self._ended_ahead.get(signum, 0) + 1

    def _die(self, signum: int) -> None:
        """End the process by ``signum``'s default action, from a thread that is not the main one.

        ``signal.signal`` works only on the main thread, which may be blocked in C;
        the C library's ``signal`` works anywhere.
        """
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc.signal(signum, None)  # SIG_DFL
            os.kill(os.getpid(), signum)
            threading.Event().wait(_DEATH_GRACE_S)
        except Exception:  # noqa: BLE001 - no C library: the exit status the shell gives a signal's death
            pass
        os._exit(128 + signum)
