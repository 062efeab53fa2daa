"""What a DCP operation was called with that its log record leaves out: ``no_dist`` and ``process_group``.

torch's start record says the rank and the world, never whether the call is ``no_dist`` (one process
saving or loading alone inside a process group) or which process group it runs on. Both decide which
ranks count a checkpoint id's operations alike, and so which ranks must derive the same trace id
(:class:`~dcp_otel.tracing.trace_ids.SequenceTables`). The record is logged from inside torch's
``_dcp_method_logger`` wrapper, a few frames above the recorder, whose ``kwargs`` hold the call's own
keyword arguments (``save``, ``async_save`` and ``load`` take both as keyword-only arguments).

The wrapper is known by its code object (one for every decorated function), taken from a function
decorated here: nothing is matched by name. Read once per operation (a DCP step's records never come
here): a walk of a few frames and one copy of the wrapper's locals. Where this torch's decorator
differs, the reader is ``None`` and every operation counts as a collective one on the default group.

Usage::

    read = CallArguments.of(logger_module)      # patches.install gives it to the recorder
    read()                                      # inside a start record: {"checkpoint_id": ..., "no_dist": True}
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from dcp_otel.live.signal_exceptions import reraise_if_signalled

#: Frames from the reader up to torch's wrapper: the starter, the recorder's start, its entry, the tap's
#: one or two methods. A few more than that, and never the whole stack.
_MAX_DEPTH = 12


def _decorated() -> None:
    """Decorated by torch's ``_dcp_method_logger`` once, never called: its wrapper's code is every wrapper's."""


class CallArguments:
    """Reads the keyword arguments of the DCP call whose record is being handled on this thread."""

    def __init__(self, wrapper_code: Any) -> None:
        self._code = wrapper_code

    @classmethod
    def of(cls, logger_module: Any) -> CallArguments | None:
        """The reader for this torch's decorator, or ``None`` where its wrapper is not a plain function."""
        try:
            code = logger_module._dcp_method_logger()(_decorated).__code__
        except Exception as exc:  # noqa: BLE001 - another torch: no reader, nothing else lost
            reraise_if_signalled(exc)
            return None
        return cls(code) if "kwargs" in code.co_varnames else None

    def __call__(self) -> Mapping[str, Any] | None:
        """The call's keyword arguments, or ``None`` when no wrapper of torch's is on this thread's stack near here."""
        frame = sys._getframe(1)
        for _ in range(_MAX_DEPTH):
            if frame is None:
                return None
            if frame.f_code is self._code:
                kwargs = frame.f_locals.get("kwargs")
                return kwargs if type(kwargs) is dict else None
            frame = frame.f_back  # type: ignore[assignment]
        return None
