"""SIGTERM and SIGINT: the spans of the open DCP calls survive, and the process ends exactly as it would have.

dcp-otel never decides how a process ends. What it does, per signal:

**SIGTERM.** Schedulers stop a job with it (torchrun passes it to its workers,
SLURM and Kubernetes to the job), and its default action ends a process
without ``atexit`` or ``finally``: a hung checkpoint would leave no span, and
every finished span still in a batch processor would be lost. So where
SIGTERM's disposition is still the default (``SIG_DFL``) and dcp-otel holds the
wakeup fd (:mod:`~dcp_otel.live.wakeup`), :meth:`SignalGuard.install` puts a
handler there. On SIGTERM:

1. the watchdog thread learns of it at once, from the wakeup fd (the main
   thread may be blocked in a C++ collective, where no Python handler runs),
   and starts a thread that ends every open DCP call as failed ("terminated by
   SIGTERM during write_data", with the stack) and builds and flushes, by the
   process's one deadline (``flush_timeout_s`` from the first sign of the end,
   :class:`~dcp_otel.live.ending.EndingClock`);
2. the main thread's handler, when it runs, only waits for that (a ``select``
   on a socket: no lock, no exporter), then restores ``SIG_DFL`` and re-raises:
   the process is killed by SIGTERM, as it would have been, with the same exit
   status and the same report from torchrun. Where the main thread is blocked
   in C, the watchdog ends it the same way once the flush is done or the
   deadline has come;
3. a second signal (SIGTERM or SIGINT) cuts the wait short, never restarts it.
   Not a SIGINT that comes once this process's parent is gone: torch's
   ``spawn`` (the ``_experimental`` checkpointer's checkpoint process) sets
   SIGINT as the signal a child gets when its parent dies, and a rank dies of
   the same SIGTERM a moment before its checkpoint process has written what it
   was doing.

The main thread stays frozen in the handler, wherever the signal found it: as
without dcp-otel, no code of the application's runs after the signal. Where it
was holding a lock the ending takes (an operation's, dcp-otel's counters'), the
ending waits for it briefly (0.5 s) and then goes on without it; a lock of the
SDK's or the builder's held there can only cost the evidence, never the bound:
the process still dies by SIGTERM at the deadline.

Only the installed handler acts for SIGTERM. A handler installed after ours
that calls ours (PyTorch Lightning's ``_HandlersCompose``, SLURM requeue
handlers, any "call the previous handler" chain) decides: ours then starts a
flush of what has finished, on another thread, and returns. A handler of ours
that someone restores after ``uninstrument()`` acts as the ``SIG_DFL`` it replaced.
While someone else holds the wakeup fd, SIGTERM is left at ``SIG_DFL``: a handler
that nobody hears while the main thread is blocked in C would make the process
die late, not at once.

**SIGINT.** dcp-otel installs no handler: Python's ``default_int_handler``
stays, so asyncio's and trio's Ctrl-C handling find it, and Ctrl-C raises
``KeyboardInterrupt`` in the main thread, which the application may catch. An
open DCP call is ended by the exception that actually unwinds it, or at exit
("interrupted at exit"), never because a signal arrived while it ran on another
thread. The watchdog, reading SIGINT from the wakeup fd, only starts a flush of
what has finished.

``DCP_OTEL_SIGNALS=off`` (``instrument(signals=False)``) installs nothing and
leaves the wakeup fd alone. Forked children get the previous dispositions back.

Usage::

    guard = SignalGuard(ending, flush_finished)
    guard.install()                 # main thread; returns the signals taken
    guard.wakeup                    # the socket the watchdog reads signal numbers from
    guard.on_byte(signum)           # (the watchdog) a byte read from it
    next_wake = guard.service()     # (the watchdog) act on what arrived; when to call again
    guard.remove()
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report
from dcp_otel.live.ending import Ending
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.live.wakeup import WakeupFd

logger = logging.getLogger("dcp_otel")

#: The signals dcp-otel reads from the wakeup fd; only SIGTERM gets a handler.
SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
#: How long the watchdog lets its re-raised signal act before it exits by itself.
_DEATH_GRACE_S: Final = 1.0
_IDLE, _ENDING, _DONE = 0, 1, 2


def is_default(signum: int, handler: Any) -> bool:
    """Whether ``handler`` is the disposition a Python process starts with for ``signum``."""
    return handler is signal.SIG_DFL or (signum == signal.SIGINT and handler is signal.default_int_handler)


class SignalGuard:
    """One process's SIGTERM handler, its reading of the wakeup fd, and its ending (see the module).

    Lock-free by design: the main thread's handler and the watchdog each write
    counters of their own, which the other only reads.
    """

    def __init__(self, ending: Ending, flush_finished: Callable[[], object]) -> None:
        self._ending = ending
        self._flush_finished = flush_finished
        self._reader, self._writer = socket.socketpair()  # the wakeup fd (signal numbers) and pokes (0 bytes)
        self._done_reader, self._done_writer = socket.socketpair()  # the ending is over: a waiting handler goes on
        for end in (self._reader, self._writer, self._done_reader, self._done_writer):
            end.setblocking(False)
        self._wakeup = WakeupFd(self._writer.fileno(), self._on_wakeup_owner)
        self._previous: dict[int, Any] = {}  # signum -> the disposition ours replaced (kept after remove())
        self._parent = os.getppid()  # a SIGINT once it is gone is its death's, not a second signal
        self.active = False
        self.reader_alive = False  # the watchdog reads the wakeup fd (set by the watchdog thread)
        self._reset_counts()
        _forksafe.register(self)

    def _reset_counts(self) -> None:
        # Written by the main thread's handler only:
        self._main_runs = 0  # SIGTERM deliveries its handler ran for
        self._chained = 0  # runs as a handler someone else's calls
        self._frames: dict[int, FrameType] = {}  # thread id -> where the signal interrupted it
        # Written by the watchdog only:
        self._woken: dict[int, int] = {int(sig): 0 for sig in SIGNALS}  # deliveries read from the wakeup fd
        self._terms_seen = 0  # SIGTERM deliveries acted on
        self._flushes_asked = 0  # signals that asked only for a flush of what finished
        self._flushes_seen = 0  # (the main thread's chained runs, counted the same way)
        self._state = _IDLE
        self._begun_deliveries = 0
        self._ending_thread: threading.Thread | None = None
        self._flush_thread: threading.Thread | None = None

    # --- set-up -------------------------------------------------------------------
    @property
    def wakeup(self) -> socket.socket:
        """Where signal numbers arrive (and 0 bytes: look again); read it without blocking."""
        return self._reader

    @property
    def installed(self) -> list[int]:
        """The signals whose handler is ours now."""
        return [sig for sig in self._previous if signal.getsignal(sig) == self._handle]

    @property
    def wakeup_owned(self) -> bool:
        """Whether the wakeup fd is ours now (nobody else took it)."""
        return self._wakeup.owned

    def install(self) -> list[int]:
        """Take the wakeup fd if it is free, and SIGTERM where it has its default disposition; main thread only.

        Returns the signals taken (``[]`` off the main thread, or while someone else holds the wakeup fd).
        """
        if threading.current_thread() is not threading.main_thread():
            logger.info("dcp_otel: instrumented off the main thread: SIGTERM and the wakeup fd are left alone")
            return []
        self.active = True
        try:
            if self._wakeup.install():
                self._take_sigterm()
        except (ValueError, OSError):  # an interpreter that will not let us: instrument() goes on without
            report("signal_setup_error", "dcp_otel could not watch for SIGTERM", exc_info=True)
        return self.installed

    def _take_sigterm(self) -> None:
        if self.active and is_default(signal.SIGTERM, signal.getsignal(signal.SIGTERM)):
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)

    def _give_back_sigterm(self) -> None:
        previous = self._previous.get(signal.SIGTERM)
        if previous is not None and signal.getsignal(signal.SIGTERM) == self._handle:  # not if someone replaced it
            signal.signal(signal.SIGTERM, previous)

    def _on_wakeup_owner(self, ours: bool) -> None:
        """Someone set the wakeup fd (``ours``: gave it back). On the main thread, inside their call."""
        if ours:
            self._take_sigterm()
        else:  # nobody would hear SIGTERM while the main thread is blocked in C: leave it to SIG_DFL
            self._give_back_sigterm()

    def remove(self) -> None:
        """Give back what :meth:`install` took (on the main thread; elsewhere the handler only goes inert).

        ``_previous`` stays: a handler of ours that someone puts back later acts as the one it replaced.
        """
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        self._give_back_sigterm()
        self._wakeup.remove()

    def close(self) -> None:
        """Close the sockets, once the wakeup fd is given back and its reader has stopped."""
        if self._wakeup.owned or self.reader_alive:
            return
        for end in (self._reader, self._writer, self._done_reader, self._done_writer):
            end.close()

    def poke(self) -> None:
        """Wake the reader of :attr:`wakeup` (a 0 byte: no signal)."""
        try:
            self._writer.send(b"\0")
        except OSError:  # full or closed: it wakes anyway, or nobody reads
            pass

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) handles signals as it would without dcp-otel."""
        self.active = False
        self.reader_alive = False
        self._parent = os.getppid()
        try:
            self._give_back_sigterm()
            self._wakeup.forget_after_fork()
        except (ValueError, OSError):
            pass
        self._previous = {}
        self._reset_counts()
        self._ending.clock.reset()
        # The parent's sockets stay the parent's: the child's signals must never reach its watchdog.
        for end in (self._reader, self._writer, self._done_reader, self._done_writer):
            end.close()
        self._reader, self._writer = socket.socketpair()
        self._done_reader, self._done_writer = socket.socketpair()
        for end in (self._reader, self._writer, self._done_reader, self._done_writer):
            end.setblocking(False)

    # --- the handler (main thread): no lock, no exporter, a bounded wait --------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signal.getsignal(signum) != self._handle:
            # Called by the handler that replaced ours (Lightning, a requeue handler): that one decides.
            if self.active:
                self._chained += 1
                self.poke()  # the watchdog flushes what has finished, on another thread
            return
        if not self.active or not self.reader_alive:
            # Uninstrumented (and put back by someone since), or no DCP operation has started: nothing of
            # ours is open, and the process ends as SIG_DFL ends it.
            self._default_action(signum)
            return
        self._main_runs += 1
        if self._state != _IDLE and self._deliveries() > self._begun_deliveries:  # a second signal
            self._ending.clock.cut()
            self.poke()
            self._default_action(signum)
            return
        if frame is not None:
            self._frames[threading.get_ident()] = frame
        self.poke()
        self._wait_for_the_ending()
        self._default_action(signum)

    def _wait_for_the_ending(self) -> None:
        fallback = time.monotonic() + self._ending.clock.timeout_s  # should the watchdog never answer
        while self._state != _DONE:
            try:
                deadline = self._ending.clock.deadline
                remaining = min(fallback, deadline if deadline is not None else fallback) - time.monotonic()
                if remaining <= 0:
                    return
                ready, _, _ = select.select([self._done_reader], [], [], remaining)
                if ready:
                    return
            except BaseException as exc:  # noqa: BLE001 - Ctrl-C (KeyboardInterrupt) during the wait: cut short, not raised
                if not (isinstance(exc, KeyboardInterrupt) and self._parent_gone()):  # (that: the parent's death)
                    self._ending.clock.cut()
                    return

    def _parent_gone(self) -> bool:
        return os.getppid() != self._parent

    @staticmethod
    def _default_action(signum: int) -> None:
        """The process ends by ``signum``'s default action, now (main thread)."""
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _deliveries(self) -> int:
        return max(self._main_runs, self._woken[signal.SIGTERM]) + self._woken[signal.SIGINT]

    # --- the watchdog's side ----------------------------------------------------------
    def on_byte(self, signum: int) -> None:
        """The watchdog read ``signum`` from the wakeup fd (0: a poke)."""
        if signum in self._woken:
            if signum == signal.SIGINT and self._state != _IDLE and self._parent_gone():
                # The SIGINT of the parent's death (torch's spawn), not a second signal: the ending goes on.
                report("parent_death_sigint", "dcp_otel: SIGINT after this process's parent died (its parent-death "
                       "signal): not a second signal, the SIGTERM ending goes on")  # fmt: skip
                return
            self._woken[signum] += 1
            if signum == signal.SIGINT and self._state == _IDLE:
                self._flushes_asked += 1

    def service(self) -> float | None:
        """Act on what arrived (the watchdog, after every wake); the ``time.monotonic()`` to be called again at."""
        if not self.active:
            return None
        now = time.monotonic()
        deliveries = self._deliveries()
        terms = max(self._main_runs, self._woken[signal.SIGTERM])
        if self._state == _IDLE and terms > self._terms_seen:
            self._terms_seen = terms
            if signal.getsignal(signal.SIGTERM) == self._handle:
                self._begin(deliveries)
            else:  # the application's handler decides; what has finished goes out meanwhile
                self._flushes_asked += 1
        elif self._state == _ENDING and deliveries > self._begun_deliveries:
            self._ending.clock.cut()
        if self._chained != self._flushes_seen:
            self._flushes_seen = self._chained
            self._flushes_asked += 1
        if self._flushes_asked and (self._flush_thread is None or not self._flush_thread.is_alive()):
            self._flushes_asked = 0
            self._flush_thread = _start("dcp-otel-signal-flush", self._flush_quietly)
        if self._state != _ENDING:
            return None
        thread = self._ending_thread
        deadline = self._ending.clock.deadline or now
        if (thread is not None and not thread.is_alive()) or now >= deadline:
            self._finish()
            return None
        return deadline

    def _begin(self, deliveries: int) -> None:
        self._state = _ENDING
        self._begun_deliveries = deliveries
        self._ending.clock.start()
        # The handler's own dict: a frame it stores a moment later (it runs after the wakeup byte) is seen too.
        self._ending_thread = _start("dcp-otel-ending", lambda: self._run_ending(self._frames))

    def _run_ending(self, frames: dict[int, FrameType]) -> None:
        try:
            self._ending(signal.Signals.SIGTERM.name, frames)
        finally:
            self.poke()

    def _finish(self) -> None:
        self._state = _DONE
        try:
            self._done_writer.send(b"\0")  # a handler waiting on the main thread goes on (and re-raises)
        except OSError:
            pass
        if signal.getsignal(signal.SIGTERM) == self._handle:  # (an ending begins only while ours is installed)
            self._die(signal.SIGTERM)

    def _flush_quietly(self) -> None:
        try:
            self._flush_finished()
        except Exception as exc:  # noqa: BLE001 - a flush must never break anything
            reraise_if_signalled(exc)
            report("flush_error", "dcp_otel failed to flush after a signal", exc_info=True)

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
        except Exception as exc:  # noqa: BLE001 - no C library: the exit status the shell gives a signal's death
            reraise_if_signalled(exc)
        os._exit(128 + signum)


def _start(name: str, target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
