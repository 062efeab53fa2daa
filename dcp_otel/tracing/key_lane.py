"""The per-key lane: a state dict's per-key records read in the logger tap's own frame.

torch logs a start and an end record for every top-level key of a state dict (``_stateful_to_state_dict.<key>``,
two a key: 20,000 for a 10,000-key state dict) on the caller's thread, inside ``async_save`` and ``save``. On the
recorder's general hot path each took a call record, a stack push and pop and a summary update: 281 Python
instructions a key, 8.5% of that save's (``benchmarks/own_share.py``). A conversion (``_stateful_to_state_dict``)
open on a thread opens a lane instead. The logger tap (:mod:`dcp_otel.attach.logger_tap`) checks the lane first
and, for that thread's per-key records, keeps the open key's start record and time (torch logs the key's end
with the same dict, so the end is known by identity), then adds the key's time to its conversion's
:class:`~dcp_otel.tracing.records.KeyStats`: a count and a total, and the heap of the slowest only for a key
that reaches its floor. Nothing per key goes on the thread's stack, and nothing is allocated that the garbage
collector tracks: a per-key call has no span and no context, and a stall report never named one (it has no
operation).

One lane at a time, for one conversion: a conversion on another thread, or one nested inside a key of the lane's
(a ``Stateful`` whose ``state_dict`` saves), takes the general path (the nested one suspends the lane until it
ends), which summarizes the same way. Whatever the lane does not recognize (a second start before an end, an end
of another key, an exception, anything malformed) goes the general way too, where it is reported as before.

Usage (what :class:`~dcp_otel.tracing.tracker.SpanRecorder` does when a conversion starts and ends)::

    recorder.open_lane(call)       # call.keys is its KeyStats
    ...                            # the tap: lane.held, lane.start_ns, lane.stats.count, ...
    recorder.release_lane(call)
"""

from __future__ import annotations

import threading
from typing import Any

from dcp_otel.tracing.records import Call, KeyStats


class KeyLane:
    """The per-key records of one conversion on one thread; read and written by that thread only (the tap)."""

    __slots__ = ("thread", "owner", "call", "stats", "held", "start_ns")

    def __init__(self, thread: int, call: Call, stats: KeyStats) -> None:
        self.thread = thread  # the thread whose records it takes: 0 while a nested conversion runs on it
        self.owner = thread
        self.call = call
        self.stats = stats  # what a key's end adds to (KeyStats.add, done in the tap's frame)
        self.held: dict[str, Any] | None = None  # the open key's start record (torch ends it with the same dict)
        self.start_ns = 0


class KeyLanes:
    """The recorder's one lane (a mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`)."""

    #: The lane open now, if any (the tap reads it before anything else, for every record).
    lane: KeyLane | None = None

    def open_lane(self, call: Call) -> None:
        """Conversion ``call`` (its ``keys`` set) starts on this thread: it takes the lane if it is free."""
        stats = call.keys
        if stats is None:
            return
        me = threading.get_ident()
        lane = self.lane
        if lane is not None and not lane.call.end_ns:  # (a conversion ended without release is free: never)
            if lane.owner == me and lane.thread == me:  # nested in one of its keys: that key ends after this
                lane.thread = 0  # its records take the general path until this conversion ends
                call.suspended = lane
            return
        self.lane = KeyLane(me, call, stats)

    def release_lane(self, call: Call) -> None:
        """Conversion ``call`` ended (or was ended): its lane is free, a lane it suspended resumes."""
        lane = self.lane
        if lane is not None and lane.call is call:
            self.lane = None
        suspended: KeyLane | None = call.suspended
        if suspended is not None:
            call.suspended = None
            if self.lane is suspended:  # (the lane it held back is still the lane)
                suspended.thread = suspended.owner
