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

from dcp_otel import semconv

EventKind = Literal["start", "end", "exception"]
_KINDS: Final = frozenset(("start", "end", "exception"))
#: Longest function name accepted; DCP's are short, per-key names carry user keys.
MAX_FUNC_NAME: Final = 256
#: torch.distributed.checkpoint.state_dict's public functions (each a DCP call of dcp-otel's making).
STATE_DICT_FUNCTIONS: Final = frozenset({"get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
                                         "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"})  # fmt: skip
#: The calls an application makes itself: one that starts inside another call of its thread either nests in
#: it or finds that call left behind (its end cut short: dcp_otel.tracing.cut_short).
ENTRY_POINTS: Final = semconv.OPERATIONS | STATE_DICT_FUNCTIONS
_NO_DETAILS: Final[Mapping[str, Any]] = MappingProxyType({})


class MalformedEvent(ValueError):
    """A DCP log record we cannot use; ``reason`` names the problem."""


class DCPEvent(NamedTuple):
    """One DCP log record, copied. A ``NamedTuple``: this is built twice per DCP step.

    ``details`` is a copy of the whole record for ``start`` events (whose
    rank, backend and class names a new operation needs, see
    :func:`operation_fields`) and empty otherwise.
    """

    kind: EventKind
    uuid: str
    func_name: str
    time_ns: int
    error: str | None = None
    details: Mapping[str, Any] = _NO_DETAILS


class OperationFields(NamedTuple):
    """What a new operation needs from its start record; parsed once per operation.

    (Its storage and planner class names are read by ``OperationStarter.class_attributes``, for nested
    calls too.)
    """

    checkpoint_id: str | None
    backend: str | None
    global_rank: int | None
    group_rank: int | None  # rank in the process group DCP was given (torch logs "local_rank")
    world_size: int | None


def operation_fields(details: Mapping[str, Any]) -> OperationFields:
    """Read the operation-level fields of a start record's copy."""
    get = details.get
    return OperationFields(
        checkpoint_id=_opt_str(get("checkpoint_id")),
        backend=_opt_str(get("backend")),
        global_rank=_opt_int(get("global_rank")),
        group_rank=_opt_int(get("local_rank")),
        world_size=_opt_int(get("world_size")),
    )


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
