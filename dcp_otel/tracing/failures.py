"""A failure, described once on the thread that saw it, and the ranks it names (global ranks).

torch's ``CheckpointException`` carries every failed rank's traceback; only one
rank's own is formatted (:class:`Failure`), the failed ranks are mapped from the
process group's numbering to global ranks without a collective
(:func:`global_rank_of`), and a one-line status says it (:func:`describe`).

Usage (what :mod:`dcp_otel.tracing.tracker` does when a call raises)::

    call.failure = Failure(exc, None, rank=op.rank, to_global=global_rank_of(op.group))
    call.failure.description   # "CheckpointException: ranks [3] failed; rank 3: OSError: disk full"
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Final

from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.redact import redact_text

#: An exception event's message and stack trace are cut to these (an OTLP batch must stay below 4 MiB).
MAX_EXCEPTION_TEXT: Final = 4096
MAX_STACKTRACE_TEXT: Final = 16384
MAX_FRAMES: Final = 16  # of each side of a multi-rank failure
#: The exception type of a call ended because its process was ending (SIGTERM, exit).
INTERRUPTED_TYPE: Final = "dcp_otel.Interrupted"

#: Maps a rank in a checkpoint's process group to its global rank.
GlobalRank = Callable[[int], int]


def _same_rank(rank: int) -> int:
    return rank


def global_rank_of(group: object | None) -> GlobalRank:
    """The global rank of each rank of process group ``group`` (``None`` or the default group: the same).

    Read from torch's own table of the group's ranks, on this process: no collective.
    """
    if group is None:
        return _same_rank
    try:
        import torch.distributed as dist

        if group is dist.group.WORLD:
            return _same_rank
        ranks = dist.get_process_group_ranks(group)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - a group torch does not know (any more): its own numbering
        reraise_if_signalled(exc)
        return _same_rank
    return lambda rank: ranks[rank] if 0 <= rank < len(ranks) else rank


def global_failures(exc: BaseException, to_global: GlobalRank = _same_rank) -> dict[int, object] | None:
    """torch's ``CheckpointException.failures`` (group rank to error) by global rank; ``None`` for another exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return None
    return {to_global(r): f for r, f in failures.items() if isinstance(r, int)}


def failed_ranks(exc: BaseException, to_global: GlobalRank = _same_rank) -> list[int] | None:
    """The failing ranks of torch's ``CheckpointException``, as global ranks."""
    failures = global_failures(exc, to_global)
    return sorted(failures) if failures is not None else None


def describe(exc: BaseException | None, error: str | None, rank: int | None = None,
             to_global: GlobalRank = _same_rank) -> str:  # fmt: skip
    """A one-line status description: the exception type and its first line.

    For ``CheckpointException`` (whose text is a multi-rank traceback dump):
    the failing ranks and one rank's own exception (``rank``'s if it failed,
    else the first failed rank's), never the whole text.
    """
    failures = global_failures(exc, to_global) if exc is not None else None
    if exc is not None and failures:
        ranks = sorted(failures)
        own = rank if rank in failures else ranks[0]
        cause = _cause(failures[own])
        cause_text = str(cause).strip().splitlines()
        detail = f"{type(cause).__name__}: {cause_text[0]}" if cause_text else type(cause).__name__
        return f"{type(exc).__name__}: ranks [{rank_ranges(ranks)}] failed; rank {own}: {detail}"
    if exc is not None:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return (error or "exception").strip().splitlines()[0] if (error or "").strip() else "exception"


class Failure:
    """A failure, described once, on the thread that saw it (failures are rare).

    The exception object is not kept: its traceback holds the frames of the
    failed call (and whatever tensors they reference) alive. Its text is taken
    now, in the form the SDK's ``record_exception`` gives an ``exception`` event,
    capped and with credentials redacted (a storage error often quotes a signed
    URL).

    torch's ``CheckpointException`` is never formatted whole: its text holds
    every failed rank's traceback (1.4 MB at 1,024 failed ranks, and 0.4 s to
    format on the training thread). Its event keeps this rank's own failure
    (``rank``; the first failed rank's when this rank did not fail), and the
    failed ranks go to ``dcp.failed_ranks``. torch keys them by the rank in the
    process group the save ran on: ``to_global`` maps those to global ranks
    (:func:`global_rank_of`), so every rank is named by its global rank.

    ``origin``: the exception is this rank's own (not torch's report of the
    failed ranks, nor one inferred), with its type in ``origin``: where a
    failure started is counted there, once. :meth:`came_from_collective` takes
    it back for an exception one of DCP's collectives raised (a peer gone).
    """

    __slots__ = ("description", "event", "failed_ranks", "origin", "in_collective")

    def __init__(self, exc: BaseException | None, error: str | None, rank: int | None = None,
                 to_global: GlobalRank | None = None) -> None:  # fmt: skip
        to_global = to_global or _same_rank
        # torch's own error text when there is no exception object (an inferred end, say)
        self.description = redact_text(describe(exc, error, rank, to_global) if exc is not None else (error or "exception"))
        self.failed_ranks = failed_ranks(exc, to_global) if exc is not None else None
        self.origin: str | None = None
        self.in_collective = False
        if exc is None:
            self.event: dict[str, Any] = {"exception.message": capped(redact_text(error or self.description))}
            return
        if self.failed_ranks is None and not any(failed_ranks(e) for e in _chain(exc)):
            self.origin = type(exc).__name__
        message, stacktrace = _exception_text(exc, rank, to_global)
        self.event = {
            "exception.type": _type_name(exc),
            "exception.message": capped(redact_text(message)),
            "exception.stacktrace": capped(redact_text(stacktrace), MAX_STACKTRACE_TEXT),
            "exception.escaped": "False",
        }

    def came_from_collective(self) -> None:
        """The exception was raised by one of DCP's collectives: another rank's failure (it went away,
        the collective timed out waiting for it), not where the failure started."""
        self.in_collective = True
        self.origin = None

    @classmethod
    def interrupted(cls, description: str, stack: str | None) -> Failure:
        """A call the process ended while it was still open ("terminated by SIGTERM during write_data").

        Its exception event has the stack of the thread that was inside the
        call as stack trace, where it is known.
        """
        failure = cls(None, description)
        failure.event = {"exception.type": INTERRUPTED_TYPE, "exception.message": capped(redact_text(description))}
        if stack:
            failure.event["exception.stacktrace"] = capped(redact_text(stack), MAX_STACKTRACE_TEXT)
        return failure


def capped(text: str, limit: int = MAX_EXCEPTION_TEXT) -> str:
    """``text``, cut to ``limit`` characters with a note of how much was cut (keeping the start and the end)."""
    if len(text) <= limit:
        return text
    note = f"\n... [{len(text) - limit} characters cut by dcp-otel] ...\n"
    head = (limit - len(note)) * 2 // 3
    return text[:head] + note + text[len(text) - (limit - len(note) - head) :]


def _type_name(exc: BaseException) -> str:
    module, qualname = type(exc).__module__, type(exc).__qualname__
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def _exception_text(exc: BaseException, rank: int | None, to_global: GlobalRank) -> tuple[str, str]:
    """The message and stack trace of ``exc``; of a multi-rank failure, only one rank's own."""
    failures = global_failures(exc, to_global)
    if not failures:
        # A multi-rank failure further down the chain (a wrapper raised from it) is summarized, not formatted whole.
        inner = next((e for e in _chain(exc) if failed_ranks(e)), None)
        if inner is None:
            return str(exc), "".join(traceback.format_exception(exc))
        summary = f"{describe(inner, None, rank, to_global)}\n\nDuring handling of the above exception, another exception occurred:\n\n"
        # (traceback's format_exception and format_exception_only build the whole chain's text, even unused)
        lines = ["Traceback (most recent call last):\n", *traceback.format_tb(exc.__traceback__, limit=-MAX_FRAMES),
                 _exception_line(exc)]  # fmt: skip
        return str(exc), summary + "".join(lines)
    ranks = sorted(failures)
    own = rank if rank in failures else ranks[0]
    cause = _cause(failures[own])
    cause_text = _exception_line(cause).strip() if isinstance(cause, BaseException) else str(cause)
    header = f"{type(exc).__name__}: ranks [{rank_ranges(ranks)}] failed ({len(ranks)}); rank {own}"
    header += " (this rank)" if own == rank else ""
    message = f"{header}: {cause_text}"
    failure = failures[own]
    remote = failure[1] if isinstance(failure, tuple) and len(failure) > 1 else None
    # The innermost frames of each side: where the coordinator raised it, and where the rank failed.
    local = traceback.format_tb(exc.__traceback__, limit=-MAX_FRAMES)
    parts = ["Traceback (most recent call last):\n", *local, f"{_type_name(exc)}: {header}\n"]
    if isinstance(remote, list):  # torch's StackSummary of the failing rank
        frames = traceback.StackSummary.from_list(list(remote)[-MAX_FRAMES:])
        parts += [f"\nrank {own}, where it failed (innermost {len(frames)} frames):\n", *frames.format()]
    parts.append(cause_text + "\n")
    return message, "".join(parts)


def _exception_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{_type_name(exc)}: {text}\n" if text else f"{_type_name(exc)}\n"


def _chain(exc: BaseException, depth: int = 8) -> list[BaseException]:
    """The exceptions ``exc`` was raised from or while handling (at most ``depth``)."""
    found: list[BaseException] = []
    current = exc.__cause__ or exc.__context__
    while current is not None and len(found) < depth and current is not exc:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _cause(failure: object) -> object:
    """The exception in one of ``CheckpointException.failures``' values (an exception, or it and its stack)."""
    return failure[0] if isinstance(failure, tuple) and failure else failure


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
