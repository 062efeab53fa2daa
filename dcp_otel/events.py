"""Turn one record of torch's ``_dcp_method_logger`` into an immutable event.

torch logs a ``dict`` and mutates that same dict between the start and the end
of a call, so everything we need is copied out here, at once, into a
:class:`DCPEvent`. Anything malformed raises :class:`MalformedEvent`; the caller
drops it with a counted warning.

A record looks like (torch 2.13)::

    {"checkpoint_id": "/ckpt/1", "uuid": "1234...", "storage_writer": "FileSystemWriter",
     "func_name": "save", "pg_name": "0", "backend": "gloo", "world_size": "2",
     "group_size": "2", "global_rank": "0", "local_rank": "0",
     "event": "start", "time": 1732262400000000000, "log_exceptions": True}
"""

from __future__ import annotations

from collections.abc import Mapping

from types import MappingProxyType
from typing import Any, Final, Literal, NamedTuple

EventKind = Literal["start", "end", "exception"]
_KINDS: Final = frozenset(("start", "end", "exception"))
#: Longest function name accepted; DCP's are short, per-key names carry user keys.
MAX_FUNC_NAME: Final = 256
_NO_DETAILS: Final = MappingProxyType({})


class MalformedEvent(ValueError):
    """A DCP log record we cannot use; ``reason`` names the problem."""


class DCPEvent(NamedTuple):
    """One DCP log record, copied. A ``NamedTuple``: this is built twice per DCP step.

    ``details`` is a copy of the whole record for ``start`` events (whose
    rank, backend and class names a new operation needs) and empty otherwise;
    the properties read it.
    """

    kind: EventKind
    uuid: str
    func_name: str
    time_ns: int
    error: str | None = None
    details: Mapping[str, Any] = _NO_DETAILS

    # Read from the copied record on demand: only a new operation needs them.
    checkpoint_id = property(lambda self: _opt_str(self.details.get("checkpoint_id")))
    storage_writer = property(lambda self: _opt_str(self.details.get("storage_writer")))
    storage_reader = property(lambda self: _opt_str(self.details.get("storage_reader")))
    planner = property(lambda self: _opt_str(self.details.get("planner")))
    backend = property(lambda self: _opt_str(self.details.get("backend")))
    global_rank = property(lambda self: _opt_int(self.details.get("global_rank")))
    #: Rank within the process group DCP was given (torch logs it as ``local_rank``).
    group_rank = property(lambda self: _opt_int(self.details.get("local_rank")))
    world_size = property(lambda self: _opt_int(self.details.get("world_size")))


def parse_event(msg: Any) -> DCPEvent:
    """Copy the fields of a DCP log message into a :class:`DCPEvent`.

    Raises:
        MalformedEvent: ``msg`` is not a dict, or lacks a usable event kind,
            uuid, function name or time.
    """
    if not isinstance(msg, dict):
        raise MalformedEvent(f"message is a {type(msg).__name__}, not a dict")
    kind = msg.get("event")
    if kind not in _KINDS:
        raise MalformedEvent(f"unknown event {kind!r}")
    call_id = msg.get("uuid")
    if type(call_id) is not str or not call_id:
        raise MalformedEvent("missing uuid")
    func_name = msg.get("func_name")
    if type(func_name) is not str or not func_name or len(func_name) > MAX_FUNC_NAME:
        raise MalformedEvent("missing or oversized func_name")
    time_ns = msg.get("time")
    if type(time_ns) is not int or time_ns <= 0:
        raise MalformedEvent(f"bad time {time_ns!r}")
    if kind == "start":
        # torch mutates this dict in place before the end event: copy it now.
        return DCPEvent(kind, call_id, func_name, time_ns, None, dict(msg))
    error = msg.get("error")
    return DCPEvent(kind, call_id, func_name, time_ns, None if error is None else str(error))


def _opt_str(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def _opt_int(value: Any) -> int | None:
    """torch logs ranks as strings ("0"); accept those and ints, nothing else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None
