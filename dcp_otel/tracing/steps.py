"""Where training steps end, with no change to the training loop: torch's global optimizer step hook.

``torch.optim.optimizer.register_optimizer_step_post_hook`` runs a hook after
every optimizer's ``step()`` in the process, whatever drives it (a plain loop,
Lightning, torchtitan, a ``GradScaler``). The hook is the hot path of every
training step, so it only writes ``time.time_ns()`` (the clock DCP's records
use) into a ring; the builder reads the ring off the training thread when a
checkpoint is built (:mod:`dcp_otel.tracing.interference`). Nothing touches a
device, synchronizes, or allocates per step.

One training step is one step of the *pace* optimizer: the first one seen.
With several optimizers stepping in turn (a GAN's two, one per pipeline stage,
one per parameter) only the pace optimizer's steps count; when another steps a
second time while the pace one has not stepped since (the pace one was thrown
away, as an LR finder's is; or it steps less often), that one becomes the pace.

The training thread's time blocked in checkpoint calls is kept beside the
steps (:meth:`StepClock.blocked_call`, one per operation call, from the
tracker): a step that contains a blocking save is not slowed by interference.

Usage::

    CLOCK.install()            # instrument(): the hook is registered
    ends, first = CLOCK.ends() # the step ends still in the ring, oldest first, and the number of the first
    CLOCK.remove()             # uninstrument(): no hook remains
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Final

from dcp_otel._wake import Wake

#: Step ends kept: a baseline before a checkpoint and the steps its upload overlapped, at 10 steps/s for 6 minutes.
RING: Final = 4096
_MASK: Final = RING - 1


class StepClock:
    """The ends of the process's training steps, in a ring written by one optimizer hook."""

    def __init__(self) -> None:
        self._ring = [0] * RING
        self.count = 0  # steps seen; the ring holds the last min(count, RING) ends
        self._pace = 0  # id() of the pace optimizer
        self._others: set[int] = set()  # id() of the other optimizers that stepped since the pace one did
        self.removed_ns = 0  # when the hook was last removed (steps after it are not seen)
        self.thread = 0  # the thread the pace optimizer steps on (0: none yet)
        #: (start_ns, end_ns) of the training thread's operation calls (a save, an async save until it returned).
        self.blocked: deque[tuple[int, int]] = deque(maxlen=256)
        self._handle: Any = None
        self._lock = threading.Lock()
        self._waiter: Wake | None = None  # set when the next step ends (wake_on_step)

    def _hook(self, optimizer: object, args: object, kwargs: object) -> None:
        # The hot path: every training step. A step of the pace optimizer is a list read, a comparison, one list
        # store and one int store.
        if id(optimizer) != self._pace:  # (its id: a reference would keep a discarded optimizer's state alive)
            self._other(optimizer)
            return
        n, now = self.count, time.time_ns()
        last = self._ring[(n - 1) & _MASK]
        # Never earlier than the last end: a wall clock stepped back makes a step of 0 s, and the builder's
        # bisections read the ends in order.
        self._ring[n & _MASK] = now if now >= last else last
        self.count = n + 1
        if self._others:
            self._others.clear()
        if self._waiter is not None:  # the builder waits for this step's end (once a checkpoint)
            self._wake()

    def _other(self, optimizer: object) -> None:
        key = id(optimizer)
        if self._pace and key not in self._others:  # (others stepping in turn with the pace one: once each)
            self._others.add(key)
            return
        # The first optimizer, or one stepping a second time while the pace one did not: the pace one is gone.
        self._pace = key
        self._others.clear()
        self.thread = threading.get_ident()  # the training thread: its checkpoint calls are its blocked time
        self._hook(optimizer, None, None)

    def wake_on_step(self, wake: Wake | None) -> None:
        """Set ``wake`` when the next step of the pace optimizer ends (once); ``None``: forget it."""
        self._waiter = wake

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    def blocked_call(self, start_ns: int, end_ns: int) -> None:
        """An operation call that ended on this thread: the training thread's is time it spent blocked (a save a
        thread of the application's own runs beside training is not). deque.append: atomic, no lock."""
        thread = self.thread
        if not thread or thread == threading.get_ident():
            self.blocked.append((start_ns, end_ns))

    def ends(self, newest: int = RING) -> tuple[list[int], int]:
        """The step ends in the ring (the ``newest`` at most), oldest first, and the number of the oldest (read off the
        training thread).

        The oldest few slots are left out: the hook may be overwriting them while they are read.
        """
        count = self.count
        ring = self._ring
        first = max(0, count - RING + 16, count - newest)
        if count == first:
            return [], first
        lo, hi = first & _MASK, count & _MASK  # (sliced in C: the builder reads it twice a checkpoint)
        return (ring[lo:hi] if lo < hi else ring[lo:] + ring[:hi]), first

    def last_end(self) -> int:
        """When the last step seen ended (0: none yet)."""
        count = self.count
        return self._ring[(count - 1) & _MASK] if count else 0

    def install(self) -> bool:
        """Register the hook (once); ``False`` where this torch has no global optimizer hooks."""
        with self._lock:
            if self._handle is not None:
                return True
            # A new clock: the first optimizer to step from now on sets the pace, and no step of an earlier
            # instrumentation (nor the time between them) is counted again.
            self._pace = self.count = self.thread = 0
            self._others.clear()
            self.blocked.clear()
            try:
                from torch.optim.optimizer import register_optimizer_step_post_hook
            except ImportError:
                return False
            self._handle = register_optimizer_step_post_hook(self._hook)
            return True

    def remove(self) -> None:
        """Remove the hook; the steps seen are kept (a checkpoint still uploading is measured against them)."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
            self.removed_ns = time.time_ns()

    @property
    def installed(self) -> bool:
        return self._handle is not None


#: A thread attribute: ``False`` on dcp-otel's own flush threads, which must not cut short the builder's wait for a
#: training step (the spool's confirmations flush the provider, whose DrainOnFlush drains the builder).
HURRY: Final = "dcp_otel_hurry"

#: The process's clock: one hook, whichever instrumentation installed it.
CLOCK: Final = StepClock()
