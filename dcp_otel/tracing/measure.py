"""A finished operation's metric observations and byte counts: what the builder records before any span.

:func:`measure` records the step and operation histograms, the blocked time,
the failure's origin and, through :func:`count_bytes` and
:func:`count_staging`, the bytes written, read and staged (summed here, on the
builder's thread, never on the caller's), which also go onto the spans as
attributes.

Usage (what :class:`~dcp_otel.tracing.builder.SpanBuilder` does)::

    measure(op, op.calls, metrics)
    count_bytes(op, None)        # the spans' byte attributes only, where no metrics are recorded
"""

from __future__ import annotations

import math
import operator
from typing import Any, Final

from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import WriteResult

from dcp_otel import semconv
from dcp_otel.attach.unlogged_calls import CheckpointFile, ConsolidatedOutput
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.tracing.outcome import failure_origin, own_call
from dcp_otel.tracing.records import KIND_OPERATION, KIND_STAGING, KIND_STEP, Call, Operation
from dcp_otel.tracing.staged import device_type


def measure(op: Operation, calls: list[Call], metrics: MetricsSink, late: bool = False) -> None:
    """Record the metrics of a finished operation (the step and operation histograms, bytes)."""
    exemplar, rank = op.exemplar, op.rank_label
    if not late:
        count_bytes(op, metrics)
        count_staging(op, metrics)
    for call in calls:
        if call.kind != KIND_STEP or not call.span_id:
            continue
        duration_s = call.duration_s
        metrics.step_done(op.name, call.func_name, rank, duration_s, exemplar)
        if call.func_name in semconv.STAGING_STEPS:
            metrics.async_phase_done(semconv.PHASE_STAGING, rank, duration_s, exemplar)
    if not late and any(call.kind == KIND_OPERATION for call in calls):
        metrics.operation_done(op.name, rank, op.failed is None, (op.end_ns - op.start_ns) / 1e9, op.wait_s,
                               op.end_ns / 1e9, exemplar)  # fmt: skip
    if not late:
        # The training thread's own call (an async save's until it returned; not its background save, nor the
        # async save process's, whose relayed counts the rank drops).
        own = own_call(op, calls)
        if own is not None and own.end_ns:
            metrics.training_blocked(op.name, rank, own.duration_s)
    if not late and op.failed is not None:
        origin = failure_origin(calls)
        if origin is not None:
            metrics.failure_started(op.name, rank, origin)


def count_staging(op: Operation, metrics: MetricsSink | None) -> None:
    """What the async save staged, on its staging spans (the rate over the one covering the copy) and counted."""
    facts = op.staging
    if facts is None:
        return
    calls = [c for c in op.calls if c.kind == KIND_STAGING or (c.kind == KIND_STEP and c.func_name in semconv.STAGING_STEPS)]
    attributes: dict[str, Any] = {
        semconv.ATTR_STAGING_BYTES: facts.nbytes,
        semconv.ATTR_STAGING_DEVICE: facts.devices,
        semconv.ATTR_STAGING_PINNED: facts.pinned,
        semconv.ATTR_STAGING_SHARED: facts.shared,
    }
    # The staging future's span covers the copy where staging is asynchronous (the step then only submits it).
    copy = next((c for c in calls if c.kind == KIND_STAGING), calls[0] if calls else None)
    for call in calls:
        extra = {**(call.extra or {}), **attributes}
        if call is copy and call.duration_s > 0:
            extra[semconv.ATTR_STAGING_RATE] = facts.nbytes / call.duration_s
        call.extra = extra
    if metrics is not None and facts.devices:
        metrics.bytes_staged(device_type(facts.devices), op.rank_label, facts.nbytes)


def count_bytes(op: Operation, metrics: MetricsSink | None) -> None:
    """Sum what DCP gathered (write results, local read plans) onto the counters and the spans.

    The bytes go on the call that gathered them (the operation span, or the
    background ``save`` of an async save) and, with the throughput, on this
    rank's operation span, which every detail mode exports.
    """
    op_call = next((call for call in op.calls if call.kind == KIND_OPERATION), None)
    # In the steps that move the bytes, less their own child calls (the checkpointer's barrier).
    io_s = sum(c.duration_s - c.children_ns / 1e9 for c in op.calls
               if c.kind == KIND_STEP and c.func_name in semconv.IO_STEPS)  # fmt: skip
    for call, obj in op.gathered:
        if isinstance(obj, ConsolidatedOutput):  # on its own span only: it rewrites what write_data wrote
            call.extra = {**(call.extra or {}), semconv.ATTR_WRITTEN_BYTES: obj.size_in_bytes()}
            continue
        counted = _counted_bytes(obj, op.storage)
        if counted is None:
            continue
        key, amount = counted
        if metrics is not None:
            if key == semconv.ATTR_WRITTEN_BYTES:
                metrics.bytes_written(op.rank_label, amount)
            else:
                metrics.bytes_read(op.rank_label, amount)
        # Summed: a call may gather more than once (torch_checkpointing reads one file per item).
        total = amount
        for target in (call,) if call is op_call else (call, op_call):
            if target is not None:
                extra = target.extra or {}
                total = extra.get(key, 0) + amount
                target.extra = {**extra, key: total}
        if op_call is not None and io_s > 0:  # (total: the operation's, set last)
            op_call.extra = {**(op_call.extra or {}), semconv.ATTR_THROUGHPUT: total / io_s}


def _counted_bytes(obj: object, storage: object | None) -> tuple[str, int] | None:
    """The bytes ``obj`` says were written or read, under the span attribute that counts them."""
    if type(obj) is WrittenBytes:
        return semconv.ATTR_WRITTEN_BYTES, obj.total
    if isinstance(obj, CheckpointFile):
        return (semconv.ATTR_WRITTEN_BYTES if obj.written else semconv.ATTR_READ_BYTES), obj.size_in_bytes()
    read = planned_read_bytes(obj, storage)
    return (semconv.ATTR_READ_BYTES, read) if read is not None else None


class WrittenBytes:
    """The bytes of a rank's write results, summed where they were gathered (see :func:`written_bytes`)."""

    __slots__ = ("total",)

    def __init__(self, total: int) -> None:
        self.total = total


_SIZE: Final = operator.attrgetter("size_in_bytes")
_IS_WRITE_RESULT: Final = WriteResult.__instancecheck__


def written_bytes(obj: object) -> int | None:
    """Total ``size_in_bytes`` if ``obj`` is DCP's list of ``WriteResult``, else ``None``.

    Called as the results are gathered, while they are still in cache (two C-level passes). Kept for the builder
    instead, 10,000 of them were summed and freed cold a checkpoint later, on the interpreter lock the training
    thread needs (the builder's CPU, ``benchmarks/own_share.py``).
    """
    if not isinstance(obj, list) or not obj or not all(map(_IS_WRITE_RESULT, obj)):
        return None
    try:
        return int(sum(map(_SIZE, obj)))  # (a writer's sizes may be numpy integers or floats)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


def planned_read_bytes(obj: object, storage: object | None) -> int | None:
    """Bytes a local ``LoadPlan`` will read, from the reader's ``storage_data``.

    A file-system reader's entries have the ``length`` of each stored item, which
    it reads whole. A safetensors reader's (``HuggingFaceStorageReader``) have a
    dtype instead, and it reads just the slice each item asks for: its elements
    times the dtype's size.
    """
    storage_data = getattr(storage, "storage_data", None)
    if not isinstance(obj, LoadPlan) or not isinstance(storage_data, dict):
        return None
    total = 0
    for item in obj.items:
        info = storage_data.get(item.storage_index)
        length = getattr(info, "length", None)
        if isinstance(length, int):
            total += length
            continue
        itemsize = getattr(getattr(info, "dtype", None), "itemsize", None)
        if isinstance(itemsize, int):
            total += math.prod(item.lengths) * itemsize
    return total
