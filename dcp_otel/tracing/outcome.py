"""What a finished operation's outcome says beyond its spans: where its failure started, and the work at risk.

Usage::

    failure_origin(calls)                 # "OSError": this rank's own exception started the failure
    at_risk(op, calls, last_save_ns)      # dcp.recovery_point.age_seconds on a failed operation's span
"""

from __future__ import annotations

from dcp_otel import semconv
from dcp_otel.tracing.records import KIND_OPERATION, KIND_STEP, Call, Operation


def failure_origin(calls: list[Call]) -> str | None:
    """The type of the first exception of this rank's own among ``calls``, if the failure started here.

    An upload's failure is left out: it is what its work raised, which counts where that work ran (this
    process's background save, or the async save process, which relays its own count).
    """
    own = [c for c in calls if c.failure is not None and c.failure.origin is not None and c.kind == KIND_STEP]
    own += [c for c in calls if c.failure is not None and c.failure.origin is not None and c.kind == KIND_OPERATION]
    first = min(own, key=lambda c: c.end_ns, default=None)
    return first.failure.origin if first is not None and first.failure is not None else None


def own_call(op: Operation, calls: list[Call]) -> Call | None:
    """The operation's own call among ``calls``: the caller's (an async save's until it returned), not its
    background save's, nor the async save process's."""
    return next((c for c in calls if c.kind == KIND_OPERATION and c.func_name == op.name), None)


def at_risk(op: Operation, calls: list[Call], last_save_ns: int | None) -> None:
    """On a failed (or interrupted) operation's span: the age of this process's last durable save, the work a
    restart from it would redo (none said before this process's first)."""
    own = own_call(op, calls)
    if own is not None and last_save_ns and op.end_ns >= last_save_ns:
        own.extra = {**(own.extra or {}), semconv.ATTR_RECOVERY_POINT_AGE: round((op.end_ns - last_save_ns) / 1e9, 3)}
