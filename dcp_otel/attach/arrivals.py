"""Who the coordinator waited for: each rank's write results carry its time, unchanged for DCP.

A save's coordinator waits in one gather for every rank's write results (``_DistWrapper.all_reduce("write")``)
and, without being told, cannot say for whom. No collective is added to tell it: each instrumented rank's
results travel wrapped in a :class:`Tagged`, which pickles as ``operator.getitem((mark, results), 1)``.
Any unpickler, dcp-otel's or not, instrumented or not, rebuilds exactly ``results`` (the same pickle of
them, inside a tuple): DCP sees the objects it would have seen. The mark is ``(TAG, rank, since_ns)``: the
rank's time since its last collective (the plan's) released it; about 50 bytes more per rank.

Only the coordinator, inside that gather, unpickles with :class:`RecordingUnpickler` (torch's
``_unpickler`` global, swapped for the gather and put back): where ``operator.getitem`` is looked up it
gets :func:`_recording_getitem`, which notes a mark before doing what ``getitem`` does. A rank that is not
instrumented sends no mark and is not among those compared. (The one thing that differs there: write
results that hold ``operator.getitem`` itself as a value, not a call of it, would hold this function.)

Usage (what the gather's patch does)::

    sent = tag(results, rank, since_ns)                # every rank, in place of its results
    with receiving() as marks:                         # the coordinator, around torch's gather
        ...                                            # marks: [(rank, since_ns), ...]
"""

from __future__ import annotations

import operator
import pickle
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

TAG: Final = "dcp-otel/arrival/1"
_C10D = "torch.distributed.distributed_c10d"
_getitem = operator.getitem
_find_class = pickle.Unpickler.find_class
_local = threading.local()


class Tagged:
    """``obj`` on its way to the coordinator with this rank's mark; pickles as the getitem that gives ``obj`` back."""

    __slots__ = ("obj", "mark")

    def __init__(self, obj: object, mark: tuple[str, int, int]) -> None:
        self.obj = obj
        self.mark = mark

    def __reduce__(self) -> tuple[Any, ...]:
        return _getitem, ((self.mark, self.obj), 1)


def tag(obj: object, rank: int, since_ns: int) -> Tagged:
    return Tagged(obj, (TAG, rank, since_ns))


def _recording_getitem(seq: Any, index: Any) -> Any:
    """``operator.getitem``, noting the mark of a :class:`Tagged` while this thread is :func:`receiving`."""
    if index == 1 and type(seq) is tuple and len(seq) == 2:
        mark = seq[0]
        if type(mark) is tuple and len(mark) == 3 and mark[0] == TAG:
            marks = getattr(_local, "marks", None)
            if marks is not None and type(mark[1]) is int and type(mark[2]) is int:
                marks.append((mark[1], mark[2]))
    return _getitem(seq, index)


class RecordingUnpickler(pickle.Unpickler):
    """pickle's unpickler, but for where ``operator.getitem`` is looked up (a mark may follow)."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "getitem" and module in ("_operator", "operator"):
            return _recording_getitem
        return _find_class(self, module, name)


_swap_lock = threading.Lock()
_swapped = 0  # threads receiving now; torch's unpickler is put back when the last one is done
_previous: Any = None


@contextmanager
def receiving() -> Iterator[list[tuple[int, int]]]:
    """Marks unpickled by torch on this thread meanwhile (the coordinator's gather), in the list given.

    Swaps torch's ``_unpickler`` only where it is still pickle's own (another tool's stays: no marks then).
    """
    global _swapped, _previous
    marks: list[tuple[int, int]] = []
    c10d = sys.modules.get(_C10D)
    swapped = False
    with _swap_lock:
        current = getattr(c10d, "_unpickler", None)
        if current is pickle.Unpickler or (current is RecordingUnpickler and _swapped):
            if not _swapped:
                _previous = current
                c10d._unpickler = RecordingUnpickler  # type: ignore[union-attr]
            _swapped += 1
            swapped = True
    _local.marks = marks
    try:
        yield marks
    finally:
        _local.marks = None
        if swapped:
            with _swap_lock:
                _swapped -= 1
                if not _swapped and getattr(c10d, "_unpickler", None) is RecordingUnpickler:
                    c10d._unpickler = _previous  # type: ignore[union-attr]
