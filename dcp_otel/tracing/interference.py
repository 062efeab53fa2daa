"""What a checkpoint's background work cost the training steps around it, measured by the builder.

An async save returns once its state dict is staged; its upload (and, with an
asynchronous stager, its staging) then runs beside training, competing for the
interpreter lock, the CPU, memory bandwidth and the network. The training
thread's time *inside* checkpoint calls is counted as blocked
(``dcp_training_blocked_seconds``); this module measures the rest: how much
slower the steps that overlapped the background work ran than the steps before.

For one operation with a background window ``(returned, durable)``:

- **step times** come from :mod:`dcp_otel.tracing.steps` (one optimizer step to
  the next), each less the time the training thread spent blocked in checkpoint
  calls inside it, so a step that contains the save is not counted twice;
- the **usual step** is the median of the last :data:`BASELINE` steps that ended
  before the window and overlapped no other checkpoint's (at least
  :data:`MIN_BASELINE` of them, else nothing is said);
- the **overlapping steps** are those that overlapped the window, the step it
  ended in included (the builder waits, bounded, for that step to end);
- the **ratio** is their mean over the usual step, and the **seconds lost** are
  their excess over it, said only when the excess is beyond noise: more than
  :data:`NOISE_SIGMAS` robust deviations (1.4826 x the MAD) for that many steps,
  and more than :data:`NOISE_FLOOR` of their usual time. Otherwise 0.

Usage::

    found = assess(ends, window=(returned_ns, durable_ns), blocked=[(call_start_ns, call_end_ns)])
    found.ratio, found.lost_s        # -> 2.3, 6.2 (12 steps took 2.3x their usual 0.43 s)
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

from dcp_otel import semconv

#: Steps before a checkpoint that make its usual step, at most and at least.
BASELINE: Final = 32
MIN_BASELINE: Final = 5
#: The excess over the usual time said as lost only beyond this many robust deviations (for that many steps) ...
NOISE_SIGMAS: Final = 3.0
#: ... and beyond this share of the steps' usual time: smaller slowdowns are not told from a busy machine.
NOISE_FLOOR: Final = 0.15
#: How long the builder waits for the step a window ended in to end: this many usual steps, within the bounds.
WAIT_STEPS: Final = 3.0
WAIT_BOUNDS_S: Final = (0.2, 2.0)
#: The newest step ends that tell how long a step takes now (:func:`wait_until_ns` reads no more).
RECENT_STEPS: Final = 9

Interval = tuple[int, int]


@dataclass(frozen=True)
class Interference:
    """What one checkpoint's background work did to the training steps it overlapped."""

    steps: int  # steps that overlapped it
    usual_s: float  # the median step before it
    ratio: float  # the overlapping steps' mean over usual_s
    lost_s: float  # their time beyond usual_s; 0 where that is within noise

    def attributes(self) -> dict[str, int | float]:
        return {semconv.ATTR_INTERFERENCE_STEPS: self.steps, semconv.ATTR_USUAL_STEP: round(self.usual_s, 6),
                semconv.ATTR_INTERFERENCE_RATIO: round(self.ratio, 4),
                semconv.ATTR_INTERFERENCE_LOST: round(self.lost_s, 6)}  # fmt: skip


def _overlap(a: Interval, b: Interval) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _near(intervals: Iterable[Interval], low: int, high: int) -> list[Interval]:
    """Those of ``intervals`` that overlap ``[low, high]``: each step is checked against a few, not all."""
    return [i for i in intervals if i[1] > low and i[0] < high]


def _touching(ends: Sequence[int], lo: int, hi: int, interval: Interval) -> range:
    """The steps among ``lo`` to ``hi - 1`` (step k: ``ends[k - 1]`` to ``ends[k]``) that ``interval`` may overlap,
    found by bisection: those that end after it starts and start before it ends."""
    first = bisect.bisect_right(ends, interval[0], lo, hi)
    last = bisect.bisect_left(ends, interval[1], lo - 1, hi)  # (step k starts before it ends: k - 1 < last)
    return range(first, min(hi, last + 1))


def step_table(ends: Sequence[int], lo: int, hi: int, blocked: Iterable[Interval],
               busy: Iterable[Interval]) -> tuple[list[int], list[bool]]:  # fmt: skip
    """Steps ``lo`` to ``hi - 1`` (``lo >= 1``): each one's nanoseconds less the time ``blocked`` inside it (may
    read below 0: clamp), and whether one of ``busy`` overlapped it. Each interval finds its steps by bisection,
    so the cost is the steps' plus the intervals', not their product (a step against every window near it took
    1.3 ms of the builder's CPU a checkpoint at one every 10 steps, 0.2 ms so: a scratch timing of the builder's
    parts in ``benchmarks/own_share.py``'s 10-tensor loop)."""
    ns = [ends[k] - ends[k - 1] for k in range(lo, hi)]
    overlapped = [False] * len(ns)
    for interval in blocked:
        for k in _touching(ends, lo, hi, interval):
            ns[k - lo] -= _overlap((ends[k - 1], ends[k]), interval)
    for interval in busy:
        for k in _touching(ends, lo, hi, interval):
            overlapped[k - lo] = overlapped[k - lo] or _overlap((ends[k - 1], ends[k]), interval) > 0
    return ns, overlapped


def assess(ends: Sequence[int], window: Interval, blocked: Sequence[Interval] = (),
           busy: Iterable[Interval] = ()) -> Interference | None:  # fmt: skip
    """The interference of background work over ``window`` with the steps ending at ``ends`` (oldest first).

    ``blocked``: the training thread's checkpoint calls; ``busy``: other checkpoints' windows, whose steps are
    no baseline, and no step of this one either (charged to that one already, never twice). ``None`` where it
    cannot tell: too few steps before, or none overlapping. Reads only the steps near the window: at most
    :data:`BASELINE` x 4 before it, however long the ring.
    """
    i = bisect.bisect_right(ends, window[0])  # ends[i]: the first step end after the window began
    j = bisect.bisect_left(ends, window[1], lo=i)  # ends[j]: the first at or after it ended (its step overlaps it)
    lo = max(1, i - 4 * BASELINE)
    if lo >= len(ends):
        return None
    hi = min(j + 1, len(ends))
    near = (ends[lo - 1], ends[hi - 1])
    ns, overlapped = step_table(ends, lo, hi, _near(blocked, *near), _near(busy, *near))
    usual: list[float] = []
    for k in range(min(i, len(ends)) - 1, lo - 1, -1):  # newest first, until enough
        if not overlapped[k - lo]:
            usual.append(max(0, ns[k - lo]) / 1e9)
            if len(usual) == BASELINE:
                break
    overlapping = [max(0, ns[k - lo]) / 1e9 for k in range(max(i, 1), hi) if not overlapped[k - lo]]
    if len(usual) < MIN_BASELINE or not overlapping:
        return None
    median = statistics.median(usual)
    if median <= 0:
        return None
    sigma = 1.4826 * statistics.median(abs(u - median) for u in usual)
    n = len(overlapping)
    excess = sum(overlapping) - n * median
    noise = max(NOISE_SIGMAS * sigma * math.sqrt(n), NOISE_FLOOR * n * median)
    return Interference(n, median, sum(overlapping) / (n * median), excess if excess > noise else 0.0)


def wait_until_ns(ends: Sequence[int], window_end: int) -> int:
    """Until when to wait for the step ``window_end`` fell in to end (0: it has, or there are no steps); ``ends``: the
    newest :data:`RECENT_STEPS` are all it reads."""
    if len(ends) < 2 or ends[-1] >= window_end:
        return 0
    recent = [b - a for a, b in pairwise(ends[-RECENT_STEPS:])]
    low, high = WAIT_BOUNDS_S
    return window_end + int(min(max(WAIT_STEPS * statistics.median(recent) / 1e9, low), high) * 1e9)


class StepLedger:
    """The builder's side: which steps it has observed, and the background windows of the checkpoints it built."""

    def __init__(self) -> None:
        self.observed = 0  # the number of the next step to observe into the histogram
        self.windows: deque[Interval] = deque(maxlen=64)

    def new_steps(self, ends: Sequence[int], first: int, upto_ns: int,
                  blocked: Sequence[Interval] = ()) -> list[tuple[float, str]]:  # fmt: skip
        """The steps ended by ``upto_ns`` not observed yet (seconds less ``blocked``), each with whether a
        checkpoint's window overlapped it."""
        start = max(self.observed, first + 1)
        lo = start - first
        if lo >= len(ends):
            return []
        hi = bisect.bisect_right(ends, upto_ns, lo)  # (the steps that ended by upto_ns)
        if hi <= lo:
            return []
        near = (ends[lo - 1], ends[hi - 1])
        ns, overlapped = step_table(ends, lo, hi, _near(blocked, *near), _near(self.windows, *near))
        self.observed = first + hi
        return [(max(0, n) / 1e9, semconv.OVERLAPS_CHECKPOINT if o else semconv.OVERLAPS_NONE)
                for n, o in zip(ns, overlapped, strict=True)]  # fmt: skip
