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

from dataclasses import dataclass
from typing import Any, Final, Literal

EventKind = Literal["start", "end", "exception"]
_KINDS: Final = frozenset(("start", "end", "exception"))
#: Longest function name accepted; DCP's are short, per-key names carry user keys.
MAX_FUNC_NAME: Final = 256


class MalformedEvent(ValueError):
    """A DCP log record we cannot use; ``reason`` names the problem."""


@dataclass(frozen=True, slots=True)
class DCPEvent:
    kind: EventKind
    uuid: str
    func_name: str
    time_ns: int
    checkpoint_id: str | None = None
    storage_writer: str | None = None
    storage_reader: str | None = None
    planner: str | None = None
    backend: str | None = None
    global_rank: int | None = None
    group_rank: int | None = None
    world_size: int | None = None
    error: str | None = None


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
    if not isinstance(call_id, str) or not call_id:
        raise MalformedEvent("missing uuid")
    func_name = msg.get("func_name")
    if not isinstance(func_name, str) or not func_name or len(func_name) > MAX_FUNC_NAME:
        raise MalformedEvent("missing or oversized func_name")
    time_ns = msg.get("time")
    if isinstance(time_ns, bool) or not isinstance(time_ns, int) or time_ns <= 0:
        raise MalformedEvent(f"bad time {time_ns!r}")
    error = msg.get("error")
    return DCPEvent(
        kind=kind,
        uuid=call_id,
        func_name=func_name,
        time_ns=time_ns,
        checkpoint_id=_opt_str(msg.get("checkpoint_id")),
        storage_writer=_opt_str(msg.get("storage_writer")),
        storage_reader=_opt_str(msg.get("storage_reader")),
        planner=_opt_str(msg.get("planner")),
        backend=_opt_str(msg.get("backend")),
        global_rank=_opt_int(msg.get("global_rank")),
        group_rank=_opt_int(msg.get("local_rank")),
        world_size=_opt_int(msg.get("world_size")),
        error=None if error is None else str(error),
    )


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
