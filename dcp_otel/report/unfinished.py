"""The ranks of a checkpoint that never finished: where each was when its process ended, or last reported.

A rank ended by SIGTERM or at exit has its open calls ended with
``dcp.interrupted`` (see :mod:`dcp_otel.live.ending`); one killed with SIGKILL
leaves only its stall reports (``dcp.stall`` spans). Either way this says which
step it was in, for how long, whether it was waiting for other ranks (and in
which collective) or stuck in its own work, and with which stack.

Usage (what :mod:`dcp_otel.report.model` does for each checkpoint)::

    ranks = find_unfinished(spans, ended={0, 1})    # ranks 0 and 1 have an operation span
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Final

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan
from dcp_otel.report.values import OPERATION_SPANS, as_number, collective_key, collective_label, rank_of


@dataclass
class Unfinished:
    """One rank of a checkpoint that never finished: where it was when its process ended or last reported."""

    rank: int
    step: str  # its innermost open step (semconv.STEP_NONE: between steps)
    seconds: float  # how long it had been there
    #: Why it ended: the signal's name, "exit", or None when no end was recorded at all (killed
    #: with SIGKILL, or the spans of its end were lost): only its stall reports say where it was.
    cause: str | None
    description: str  # "terminated by SIGTERM during write_data", or what its last stall report said
    waiting_in: str | None = None  # the collective (or wait step) it was waiting in for other ranks
    where: str | None = None  # the checkpoint process it was in, when not the rank itself
    stack: str | None = None  # the stack of the thread that was inside the call
    stalls: int = 0  # stall reports of this rank in this checkpoint

    @property
    def waiting(self) -> bool:
        """It was waiting for other ranks, not doing its own work."""
        return self.waiting_in is not None


def find_unfinished(spans: list[FileSpan], ended: set[int]) -> list[Unfinished]:
    """The ranks whose part never ended: ended as their process ended (``dcp.interrupted``), or, with no
    operation span at all (``ended``: the ranks that have one), only reported stalled."""
    by_id = {s.span_id: s for s in spans}
    by_rank: dict[int, list[FileSpan]] = defaultdict(list)
    for span in spans:
        rank = rank_of(span)
        if rank is not None:
            by_rank[rank].append(span)
    found = []
    for rank, mine in sorted(by_rank.items()):
        interrupted = [s for s in mine if s.attributes.get(semconv.ATTR_INTERRUPTED)]
        stalls = sorted((s for s in mine if s.name == semconv.SPAN_STALL), key=lambda s: s.start_ns)
        if interrupted:
            found.append(_interrupted_rank(rank, mine, interrupted, stalls, by_id))
        elif stalls and rank not in ended:
            found.append(_stalled_rank(rank, stalls))
    return sorted(found, key=lambda u: (u.waiting, u.rank))


def _interrupted_rank(rank: int, mine: list[FileSpan], interrupted: list[FileSpan], stalls: list[FileSpan],
                      by_id: dict[str, FileSpan]) -> Unfinished:  # fmt: skip
    # The innermost call it was in is the latest to start: a call nests in the one open when it began.
    # In one of DCP's collectives it was between steps, waiting: the call that made it is the one.
    collective = next((s for s in interrupted if semconv.is_collective_span(s.name)), None)
    inner = max((s for s in interrupted if s is not collective), key=lambda s: s.start_ns, default=interrupted[0])
    parent = by_id.get(inner.parent_id)
    own_operation = inner.name in OPERATION_SPANS and (parent is None or parent.name == semconv.SPAN_CHECKPOINT)
    step = semconv.STEP_NONE if own_operation else inner.name.removeprefix(semconv.SPAN_PREFIX)
    # Between steps: since the last of its steps ended.
    ended = {s.span_id for s in interrupted}
    last_end = max((s.end_ns for s in mine if s.parent_id == inner.span_id and s.span_id not in ended
                    and s.name != semconv.SPAN_STALL and s.end_ns <= inner.end_ns), default=inner.start_ns)  # fmt: skip
    stall = next((s for s in reversed(stalls) if s.parent_id == inner.span_id), None)  # reported on this call
    description = inner.status_message or inner.exception or "interrupted"
    waiting = _WAITING_IN.search(description)
    waiting_in = waiting.group(1) if waiting else _collective(stall)
    if waiting_in is None and collective is not None:
        waiting_in = collective_label(*collective_key(collective))
    if waiting_in is None and step in semconv.WAIT_STEPS:
        waiting_in = step
    return Unfinished(rank=rank, step=step, seconds=(inner.end_ns - max(inner.start_ns, last_end)) / 1e9,
                      cause=str(inner.attributes[semconv.ATTR_INTERRUPTED]), description=description,
                      waiting_in=waiting_in, where=_where(stall) or _where_from(description),
                      stack=inner.stacktrace or _stack(stall), stalls=len(stalls))  # fmt: skip


def _stalled_rank(rank: int, stalls: list[FileSpan]) -> Unfinished:
    """A rank that never ended the operation, as its last stall report saw it (SIGKILL leaves no more)."""
    last = stalls[-1]
    step = str(last.attributes.get(semconv.ATTR_STEP, semconv.STEP_NONE))
    seconds = as_number(last.attributes.get(semconv.ATTR_STALL_SECONDS)) or 0.0
    where = "between steps" if step == semconv.STEP_NONE else f"in {step}"
    return Unfinished(rank=rank, step=step, seconds=seconds, cause=None,
                      description=f"no end recorded; last reported stalled {where} after {seconds:.1f} s",
                      waiting_in=_collective(last), where=_where(last), stack=_stack(last),
                      stalls=len(stalls))  # fmt: skip


#: How an interrupted call's description names the collective it waited in.
_WAITING_IN: Final = re.compile(r"waiting in (.+)$")
_IN_PROCESS: Final = re.compile(r" in the (.+? process)\b")


def _collective(stall: FileSpan | None) -> str | None:
    if stall is None or not stall.attributes.get(semconv.ATTR_STALL_COLLECTIVE):
        return None
    name, caller = stall.attributes[semconv.ATTR_STALL_COLLECTIVE], stall.attributes.get(semconv.ATTR_STALL_COLLECTIVE_CALLER)
    return f"{name} ({caller})" if caller else str(name)


def _where(stall: FileSpan | None) -> str | None:
    where = stall.attributes.get(semconv.ATTR_STALL_WHERE) if stall is not None else None
    return str(where) if where else None


def _where_from(description: str) -> str | None:
    found = _IN_PROCESS.search(description)
    return found.group(1) if found else None


def _stack(stall: FileSpan | None) -> str | None:
    stack = stall.attributes.get(semconv.ATTR_CODE_STACKTRACE) if stall is not None else None
    return stack if isinstance(stack, str) else None
