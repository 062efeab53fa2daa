"""The per-key lane: a state dict's per-key records read in the logger tap's own frame.

torch logs a start and an end record for every top-level key of a state dict (``_stateful_to_state_dict.<key>``,
two a key: 20,000 for a 10,000-key state dict) on the caller's thread, inside ``async_save`` and ``save``. On the
recorder's general hot path each took a call record, a stack push and pop and a summary update: 281 Python
instructions a key, 8.5% of that save's (``benchmarks/own_share.py``). A conversion (``_stateful_to_state_dict``)
open on a thread opens a lane instead, and the logger tap (:mod:`dcp_otel.attach.logger_tap`, told through
:class:`LaneWatch`) puts a reader of that lane in its ``debug``'s place until the lane is released: for that
thread's per-key records it keeps the open key's start record (torch logs the key's end with the same dict, so the
end is known by identity), then adds the key's time (torch's ``times_spent``) to its conversion's
:class:`~dcp_otel.tracing.records.KeyStats`: a count and a total, and the heap of the slowest only for a key
that reaches its floor. Nothing per key goes on the thread's stack, and nothing is allocated that the garbage
collector tracks: a per-key call has no span and no context, and a stall report never named one (it has no
operation).

One lane at a time, for one conversion, and only while that conversion is the innermost call on its thread: a
conversion on another thread takes the general path (a per-key call on its thread's stack), which summarizes the
same way, and so do the calls inside one of the lane's keys (a ``Stateful`` whose ``state_dict`` saves: that
save's conversion finds the lane held). Whatever the lane does not recognize (a second start before an end, an
end of another key, an exception, anything malformed) goes the general way too, where it is reported as before.
A lane whose conversion is no longer open (its start cut short by a signal handler's exception, the process's
ending) is free for the next conversion.

Usage (what :class:`~dcp_otel.tracing.tracker.SpanRecorder` does when a conversion starts and ends)::

    recorder.open_lane(call)       # call.keys is its KeyStats
    ...                            # the tap: lane.stack[-1] is lane.call, lane.held, lane.stats.count, ...
    recorder.release_lane(call)
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from dcp_otel.tracing.records import Call, KeyStats


class LaneWatch(Protocol):
    """Told when a lane opens and when it is released (the logger tap: it reads a lane's records in a frame of
    its own while the lane is open)."""

    def lane_opened(self, lane: KeyLane) -> None: ...

    def lane_released(self, lane: KeyLane) -> None: ...


class KeyLane:
    """The per-key records of one conversion on one thread; read and written by that thread only (the tap)."""

    __slots__ = ("thread", "stack", "call", "stats", "held", "start_ns")

    def __init__(self, thread: int, stack: list[Call], call: Call, stats: KeyStats) -> None:
        self.thread = thread  # the thread whose records it takes
        self.stack = stack  # that thread's open calls: the lane's only while ``call`` is the innermost
        self.call = call
        self.stats = stats  # what a key's end adds to (KeyStats.add, done in the tap's frame)
        self.held: Any = None  # (dict or None) the open key's start record (torch ends it with the same dict)
        self.start_ns = 0


class KeyLanes:
    """The recorder's one lane (a mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`)."""

    if TYPE_CHECKING:  # what the recorder holds
        _open: dict[str, Call]

        def _stack(self) -> list[Call]: ...

    #: The lane open now, if any (the tap reads it before anything else, for every record).
    lane: KeyLane | None = None
    #: Told of every lane opened and released (the tap, once installed).
    lane_watch: LaneWatch | None = None

    def open_lane(self, call: Call) -> None:
        """Conversion ``call`` (its ``keys`` set) starts on this thread: it takes the lane unless an open
        conversion holds it."""
        stats = call.keys
        if stats is None:
            return
        lane = self.lane
        if lane is not None and self._open.get(lane.call.uuid) is lane.call:
            return  # held (by a conversion on another thread, or by the one a key of which runs this one)
        self.lane = lane = KeyLane(threading.get_ident(), self._stack(), call, stats)
        watch = self.lane_watch
        if watch is not None:
            watch.lane_opened(lane)

    def release_lane(self, call: Call) -> None:
        """Conversion ``call`` ended (or was ended, or its start undone): the lane, if it held it, is free."""
        lane = self.lane
        if lane is not None and lane.call is call:
            self.drop_lane()

    def drop_lane(self) -> None:
        """No lane from now on, whatever holds it (the recorder's close, a child's start after a fork)."""
        lane, self.lane = self.lane, None
        watch = self.lane_watch
        if lane is not None and watch is not None:
            watch.lane_released(lane)
