"""The taps that fixed_cost.py's uninstrumented arms put at dcp-otel's hook, torch's DCP logger global.

Each is dcp-otel's own tap (``DCPLoggerTap``: every record passed on to torch's logger as it does), its
recorder's hot path replaced: by a bare span per DCP call made by hand, by the training thread's part of
the raw-records design (not built), or by a loop of trivial instructions. See fixed_cost.py's docstring
for what each arm measures.
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch.distributed.checkpoint.logger as dcp_logger
from opentelemetry import context, trace

from dcp_otel.attach.logger_tap import DCPLoggerTap
from dcp_otel.attach.patches import PATCHES, resolve
from dcp_otel.attach.wrapping import wrap
from dcp_otel.tracing.light import span_context as light_span_context
from dcp_otel.tracing.light import with_span

#: The bare span's attributes: as many as a step's own, of the same kinds.
BARE_ATTRIBUTES = {"dcp.rank": 0, "dcp.checkpoint_id": "/dev/shm/checkpoints/step-1000", "dcp.operation": "save",
                    "dcp.world_size": 1}  # fmt: skip


class BareSpansByHand(DCPLoggerTap):
    """Hand-written instrumentation at dcp-otel's hook, torch's logger global: one bare span per DCP call.

    Each call's start record starts a span with :data:`BARE_ATTRIBUTES` and makes it current; its end
    record detaches and ends it; torch's logger then gets the record exactly as from dcp-otel's tap
    (this is the tap, its recorder's hot path replaced by the span). What a bare span costs amid a real
    save, measured as the bill is.
    """

    def __init__(self, logger: Any, tracer: trace.Tracer) -> None:
        super().__init__(logger, SimpleNamespace(on_record=self._span, lane=None))  # type: ignore[arg-type]
        self.tracer, self.open, self.spans = tracer, {}, 0

    def _span(self, msg: dict[str, Any]) -> bool:
        if msg["event"] == "start":
            span = self.tracer.start_span("dcp." + msg["func_name"], attributes=BARE_ATTRIBUTES)
            self.open[msg["uuid"]] = (span, context.attach(trace.set_span_in_context(span)))
            self.spans += 1
        else:
            span, token = self.open.pop(msg["uuid"])
            context.detach(token)
            span.end()
        return True


class DesignCore(DCPLoggerTap):
    """The training thread's part of the raw-records design, at dcp-otel's hooks (fixed_cost.py's "design core" arm).

    This is the tap (passing each record on to torch's logger as it does), its recorder's hot path
    replaced by a raw append, and wrappers (made as dcp-otel makes them) at the same collective and pickling points; each only
    appends a raw tuple to a per-thread log, and a call's start makes a light span (a chosen span id,
    non-recording) current.
    """

    def __init__(self, logger: Any) -> None:
        super().__init__(logger, SimpleNamespace(on_record=self._raw_record, lane=None))  # type: ignore[arg-type]
        self.local, self.wrapped = threading.local(), []
        self.var: Any = getattr(getattr(context, "_RUNTIME_CONTEXT", None), "_current_context", None)
        self.trace_id = random.getrandbits(128) or 1
        self.flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)

    def _log(self) -> Any:
        try:
            return self.local.log
        except AttributeError:
            self.local.log, self.local.tokens = collections.deque(maxlen=100_000), []
            return self.local.log

    def _raw_record(self, msg: dict[str, Any]) -> bool:
        log = self._log()
        log.append((msg.get("uuid"), msg.get("func_name"), msg.get("event"), msg.get("time")))
        if msg.get("event") == "start":
            ctx = self.var.get()
            light = trace.NonRecordingSpan(light_span_context(self.trace_id, random.getrandbits(64) or 1, self.flags))
            self.local.tokens.append(self.var.set(with_span(ctx, light)))
        elif self.local.tokens:
            self.var.reset(self.local.tokens.pop())
        return True

    def wrap(self) -> None:
        """Raw appends at the points dcp-otel's patches wrap around DCP's collectives and torch's pickling."""
        for patch in PATCHES:
            if not (patch.name.startswith("_DistWrapper.") or patch.name in ("_object_to_tensor", "_tensor_to_object")):
                continue
            target = resolve(patch)
            if target is None:
                continue
            owner, attr = target
            self.wrapped.append((owner, attr, vars(owner)[attr]))
            wrap(owner, attr, self._raw(attr), patch.hot)  # as dcp-otel wraps it

    def unwrap(self) -> None:
        for owner, attr, original in reversed(self.wrapped):
            setattr(owner, attr, original)
        self.wrapped.clear()

    def _raw(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A hot patch's replacer (``patches.Patch``): the replacement appends raw records around the original."""

        def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
            def replacement(*args: Any, **kwargs: Any) -> Any:  # (a method's self is args[0])
                log = self._log()
                log.append((None, name, "start", time.time_ns()))
                result = original(*args, **kwargs)
                log.append((None, name, "end", time.time_ns()))
                return result

            return replacement

        return replacer


class TrivialOps(DCPLoggerTap):
    """The tap, its recorder's hot path replaced by ``loops`` additions to a local integer per record."""

    def __init__(self, logger: Any, loops: int) -> None:
        super().__init__(logger, SimpleNamespace(on_record=self._count, lane=None))  # type: ignore[arg-type]
        self.loops = loops

    def _count(self, msg: dict[str, Any]) -> bool:
        x = 0
        for _ in range(self.loops):
            x += 1  # noqa: SIM113 - the work is the counting
        return True


@contextlib.contextmanager
def tapped(tap: DCPLoggerTap | None) -> Iterator[None]:
    """``tap`` (if any) at dcp-otel's hook, torch's logger global, and the design core's wrappers, for a block."""
    if tap is None:
        yield
        return
    dcp_logger._dcp_logger = tap  # type: ignore[assignment]
    if isinstance(tap, DesignCore):
        tap.wrap()
    try:
        yield
    finally:
        if isinstance(tap, DesignCore):
            tap.unwrap()
        dcp_logger._dcp_logger = tap.logger


def made_by(tap: DCPLoggerTap | None) -> int:
    """What an arm's own tap has made so far: bare spans by hand, or the design core's raw records."""
    if isinstance(tap, BareSpansByHand):
        return tap.spans
    return len(tap._log()) if isinstance(tap, DesignCore) else 0
