"""One trace per checkpoint operation across all ranks, with no collective.

Every rank derives the same trace id from what it already knows: the run id,
the torchelastic restart count, the generation of its workers (see
:func:`round_generation`), the operation, the (redacted) checkpoint id and a
per-process sequence number of that (operation, checkpoint id) pair. Ranks call
DCP operations in the same order (SPMD), so their sequence numbers agree; two
saves to the same id are two traces, and two runs never share one.

The coordinator rank emits the root span ``dcp.checkpoint`` whose span id is
derived too; every other rank parents its operation span to that id without
ever talking to the coordinator.

Usage::

    ids = derive_ids(CheckpointKey("job-42", "0", "save", "/ckpt/step-10", round_generation()), seq=0)
    ids.trace_id, ids.root_span_id    # identical on every rank
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
import uuid
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled

logger = logging.getLogger("dcp_otel")

#: Values of ``TORCHELASTIC_RUN_ID`` that do not identify a run (torchrun's
#: static rendezvous uses "none" unless ``--rdzv-id`` is given).
_NO_RUN_ID = frozenset({"", "none"})


class RunIdentity(NamedTuple):
    run_id: str
    source: str  # where it came from, for the docs and the warning


def resolve_run_id(explicit: str | None, world_size: int) -> RunIdentity:
    """Find the id of this job run, the same on every rank.

    Order: ``explicit`` (the ``run_id=`` option or ``$DCP_OTEL_RUN_ID``), then
    ``$TORCHELASTIC_RUN_ID`` unless it is ``none``, then ``$SLURM_JOB_ID``
    (with ``$SLURM_STEP_ID``). With none of those, a single-process job uses a
    random id (nothing to agree with), and a multi-rank job falls back to
    ``MASTER_ADDR:MASTER_PORT``, which two runs can share: callers warn then.
    """
    if explicit:
        return RunIdentity(explicit, "option")
    env = os.environ
    elastic = env.get(semconv.ENV_TORCHELASTIC_RUN_ID, "").strip()
    if elastic.lower() not in _NO_RUN_ID:
        return RunIdentity(elastic, semconv.ENV_TORCHELASTIC_RUN_ID)
    slurm = env.get(semconv.ENV_SLURM_JOB_ID, "").strip()
    if slurm:
        step = env.get(semconv.ENV_SLURM_STEP_ID, "").strip()
        return RunIdentity(f"slurm-{slurm}.{step}" if step else f"slurm-{slurm}", semconv.ENV_SLURM_JOB_ID)
    if world_size <= 1:
        return RunIdentity(_PROCESS_NONCE, "random")
    return RunIdentity(f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}", "fallback")


_PROCESS_NONCE = uuid.uuid4().hex


def environment_run_id(explicit: str | None = None) -> str:
    """The run id as every rank resolves it before ``torch.distributed`` is up: ``explicit``, else
    ``$DCP_OTEL_RUN_ID``, then :func:`resolve_run_id`'s launcher variables, for ``$WORLD_SIZE`` ranks."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    explicit = explicit or os.environ.get(semconv.ENV_RUN_ID, "").strip() or None
    return resolve_run_id(explicit, int(world) if world.isdigit() else 1).run_id


class CheckpointKey(NamedTuple):
    """What every rank knows about one operation before it starts."""

    run_id: str
    restart_count: str
    operation: str
    checkpoint_id: str  # redacted: signed URLs differ per rank, their redaction does not
    generation: str = ""  # of the workers that run it: round_generation()


_generation_lock = threading.Lock()
_generation: tuple[Any, str] | None = None  # (weak reference to the default process group, its generation)
_c10d: Any = None  # torch.distributed.distributed_c10d, imported at the first operation (not with dcp_otel)


def round_generation(explicit: str | None = None) -> str:
    """A value every rank of this round of workers shares, and the next round does not.

    The sequence numbers restart at 0 with every new process, and the run id and
    ``TORCHELASTIC_RESTART_COUNT`` do not always change between rounds: an
    elastic membership change does not count as a restart, a pod restarted with a
    fixed rendezvous id and a SLURM requeue start over at 0 with the same ids. So
    without this, two rounds would emit the same trace ids and root span ids.

    First that applies: ``$DCP_OTEL_GENERATION`` (``dcp-otel-run`` sets it for
    its workers from the rendezvous round's own store, so every round differs;
    ``explicit`` is its value when the caller read it already: an operation's
    start reads the environment once per process); else the ranks agree through
    the default process group's store, once per process group: the first rank to
    ask stores a random value (``compare_set``: one store round trip, no
    collective, no waiting for other ranks), every other rank reads it. A new
    round's store is new (a requeue, a restarted pod, a plain
    ``init_process_group``); torchrun's rendezvous store survives membership
    changes, which only ``dcp-otel-run`` tells apart. With no process group:
    ``""`` (a single process keys its traces by pid already).

    Called at every operation's start: once the group's generation is known, it
    costs a check that the default group is still the same (no import, no lock).
    """
    if explicit is None:
        explicit = os.environ.get(semconv.ENV_GENERATION, "").strip()
    if explicit:
        return explicit
    global _generation
    group = _default_group()
    if group is None:  # no process group (or not this torch): no generation
        return ""
    c10d = _c10d
    known = _generation  # (one tuple, replaced whole: read without the lock)
    if known is not None and known[0]() is group:
        return known[1]
    with _generation_lock:
        if _generation is not None and _generation[0]() is group:
            return _generation[1]
        key = "/".join((semconv.STORE_GENERATION_KEY, os.environ.get(semconv.ENV_TORCHELASTIC_RESTART_COUNT, "0"),
                        str(group.size())))  # fmt: skip
        try:
            generation = agree_on_generation(c10d._get_default_store(), key)
        except Exception as exc:  # noqa: BLE001 - no generation: the ids of two rounds may then coincide
            reraise_if_signalled(exc)
            report("no_generation", "dcp_otel: could not agree on a worker generation through the process group's "
                   "store; two rounds of workers may share trace ids", exc_info=True)  # fmt: skip
            generation = ""
        _generation = (weakref.ref(group), generation)  # once per process group, even when it failed
        return generation


def _default_group() -> Any:
    """The default process group, or ``None`` (no torch.distributed, not initialized, or not this torch).

    torch.distributed is imported at the first operation, not with dcp_otel, and kept in ``_c10d``.
    """
    global _c10d
    c10d = _c10d
    try:
        if c10d is None:
            from torch.distributed import distributed_c10d as c10d

            _c10d = c10d
        return c10d._get_default_group() if c10d.is_initialized() else None
    except Exception as exc:  # noqa: BLE001 - not this torch
        reraise_if_signalled(exc)
        return None


def agree_on_generation(store: Any, key: str) -> str:
    """The generation stored under ``key``: the first caller's random value (``compare_set``), for every caller."""
    value = store.compare_set(key, "", uuid.uuid4().hex[:16])
    return value.decode() if isinstance(value, bytes) else str(value)
class DerivedIds(NamedTuple):
    trace_id: int
    root_span_id: int


def derive_ids(key: CheckpointKey, seq: int) -> DerivedIds:
    """The trace id and root span id of the ``seq``-th operation with ``key``."""
    material = "\x1f".join((*key, str(seq))).encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(material).digest()
    # An all-zero id is invalid in W3C trace context; 2**-128 odds, but be exact.
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return DerivedIds(trace_id, span_id)


#: Checkpoint keys a process remembers the count of, per process group. Most ids are saved once
#: (``step-2000``), so a table would grow by one entry per checkpoint, forever; the least recently used
#: is forgotten past this. An id saved again after this many other ids starts at 0 again (its trace id
#: repeats its first save's); one that keeps being reused (``latest``) stays remembered.
MAX_KEYS = 16_384


class SequenceCounter:
    """Per-process count of operations by key, the :data:`MAX_KEYS` most recently used; thread-safe."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._lock = threading.Lock()
        self._next: OrderedDict[CheckpointKey, int] = OrderedDict()
        self._max_keys = max_keys

    def reset_lock(self) -> None:
        """After ``fork``: a lock no thread of the child holds (the counts stay)."""
        self._lock = threading.Lock()

    def next(self, key: CheckpointKey) -> int:
        with self._lock:
            counts = self._next
            # Read and counted with no call between (a signal handler's exception, raised at a call, would leave
            # the key out, and the next operation would take sequence 0 again: another operation's trace).
            seq = 0
            if key in counts:
                seq = counts[key]
                del counts[key]
            counts[key] = seq + 1  # the most recently used, last
            if len(counts) > self._max_keys:
                counts.popitem(last=False)
            return seq

    def __len__(self) -> int:
        return len(self._next)


class SequenceTables:
    """The sequence counts of one process: a :class:`SequenceCounter` per process group, one for ``no_dist`` calls.

    Why not one table: a bounded table forgets its least recently used key, and which key that is depends
    on every operation the table has seen. Ranks of one checkpoint must derive the same sequence number,
    so their tables must have seen the same operations in the same order. A group's collective operations
    are made by every rank of the group in the same order (DCP's collectives would deadlock otherwise), so
    a table that sees only them is the same on every rank of the group, and evicts alike: its ranks cannot
    disagree. What only some ranks make (``no_dist`` saves, a subgroup's saves) goes to tables the other
    ranks' checkpoints never read. A table per group is created at its first operation and goes with it.

    Usage::

        seq = tables.counter(group=None, private=False).next(key)   # the default group's table
    """

    def __init__(self, max_keys: int | None = None) -> None:
        self._max_keys = max_keys = MAX_KEYS if max_keys is None else max_keys  # (read now: a test may lower it)
        self.default = SequenceCounter(max_keys)
        self.private = SequenceCounter(max_keys)
        self._groups: weakref.WeakKeyDictionary[Any, SequenceCounter] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def counter(self, group: Any = None, private: bool = False) -> SequenceCounter:
        """The table for an operation on ``group`` (``None``: the default group), or for a ``no_dist`` one."""
        if private:
            return self.private
        if group is None or group is _default_group():
            return self.default
        try:
            with self._lock:
                found = self._groups.get(group)
                if found is None:
                    found = self._groups[group] = SequenceCounter(self._max_keys)
                return found
        except TypeError:  # a group that cannot be weakly referenced: counted with the default group, as before
            return self.default

    def reset_lock(self) -> None:
        """After ``fork``: locks no thread of the child holds (the counts stay)."""
        self._lock = threading.Lock()
        for table in (self.default, self.private, *self._groups.values()):
            table.reset_lock()


class _OverridableIds:
    """Wraps a tracer's id generator so that one span can get chosen ids.

    The SDK tracer reads ``tracer.id_generator`` for every span it starts; only
    the twin tracer of :func:`chosen_ids_tracer` holds this wrapper, and only
    while :func:`start_root_span` runs on the calling thread are the ids
    overridden.
    """

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self._local = threading.local()

    def set_next(self, ids: DerivedIds | None) -> None:
        self._local.ids = ids

    def generate_trace_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        return ids.trace_id if ids is not None else self.inner.generate_trace_id()

    def generate_span_id(self) -> int:
        ids: DerivedIds | None = getattr(self._local, "ids", None)
        if ids is not None:
            self._local.ids = None  # one span only: the next span gets a random id
            return ids.root_span_id
        return self.inner.generate_span_id()

    def is_trace_id_random(self) -> bool:
        # Derived ids are not random in the W3C sense; only our root spans use them.
        if getattr(self._local, "ids", None) is not None:
            return False
        # Older SDKs' IdGenerator has no is_trace_id_random (it arrived after 1.27).
        is_random = getattr(self.inner, "is_trace_id_random", None)
        return bool(is_random()) if is_random is not None else False


def supports_chosen_ids(tracer: trace.Tracer) -> bool:
    """Whether ``tracer`` (an SDK tracer) lets us choose the root span's ids."""
    return hasattr(tracer, "id_generator") and hasattr(tracer, "sampler")


def chosen_ids_tracer(tracer: trace.Tracer) -> tuple[trace.Tracer, _OverridableIds] | None:
    """A twin of ``tracer`` that can start a span with chosen ids, or ``None``.

    The twin is a shallow copy: the same scope, sampler, resource and span
    processors, so its spans export exactly like ``tracer``'s; only its id
    generator is wrapped. ``tracer`` itself is left untouched, so the spans it
    starts (every step of every operation) pay nothing for the override.
    """
    if not supports_chosen_ids(tracer):
        return None
    twin = copy.copy(tracer)
    overrides = _OverridableIds(tracer.id_generator)  # type: ignore[attr-defined]
    twin.id_generator = overrides  # type: ignore[attr-defined]
    return twin, overrides


def start_span_with_ids(
    tracer: trace.Tracer,
    overrides: _OverridableIds,
    ids: DerivedIds,
    name: str,
    ctx: context_api.Context,
    **kwargs: object,
) -> trace.Span:
    """Start a span in ``ctx`` whose span id is ``ids.root_span_id`` (and, with no parent, trace id ``ids.trace_id``)."""
    overrides.set_next(ids)
    try:
        return tracer.start_span(name, context=ctx, **kwargs)  # type: ignore[arg-type]
    finally:
        overrides.set_next(None)


def start_root_span(
    tracer: trace.Tracer,
    overrides: _OverridableIds,
    ids: DerivedIds,
    name: str,
    ctx: context_api.Context,
    **kwargs: object,
) -> trace.Span:
    """Start a root span (no parent) whose trace and span ids are ``ids``."""
    root_ctx = trace.set_span_in_context(trace.INVALID_SPAN, ctx)
    return start_span_with_ids(tracer, overrides, ids, name, root_ctx, **kwargs)


def sampling_flags(tracer: trace.Tracer, trace_id: int) -> TraceFlags:
    """The tracer's sampler's decision for a checkpoint's root span with ``trace_id``.

    Every rank derives the same trace id, so a ratio sampler keeps or drops a
    checkpoint on all ranks alike. A tracer with no sampler (not the SDK's)
    samples; a proxy or no-op tracer (no SDK configured) records nothing.
    """
    if isinstance(tracer, (trace.ProxyTracer, trace.NoOpTracer)):
        return TraceFlags(TraceFlags.DEFAULT)
    sampler = getattr(tracer, "sampler", None)
    if sampler is None:
        return TraceFlags(TraceFlags.SAMPLED)
    result = sampler.should_sample(
        context_api.Context(), trace_id, semconv.SPAN_CHECKPOINT, SpanKind.INTERNAL, None, None
    )
    return TraceFlags(TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT)


def static_sampling_flags(tracer: trace.Tracer) -> TraceFlags | None:
    """The flags :func:`sampling_flags` gives every checkpoint of ``tracer``, when its sampler's decision
    for a root span cannot depend on the trace id; else ``None`` (ask per checkpoint).

    Constant: the SDK's ``ALWAYS_ON``/``ALWAYS_OFF`` and ``ParentBased`` with one of them at its root
    (the SDK's default, ``parentbased_always_on``); exact types only, since a subclass may decide
    otherwise. A ratio sampler, or any other, is asked per checkpoint.
    """
    sampler = getattr(tracer, "sampler", None)
    if type(sampler) is ParentBased:
        sampler = getattr(sampler, "_root", None)
    if type(sampler) is not StaticSampler:
        return None
    decision = getattr(sampler, "_decision", None)
    if not isinstance(decision, Decision):
        return None
    return TraceFlags(TraceFlags.SAMPLED if decision is Decision.RECORD_AND_SAMPLE else TraceFlags.DEFAULT)


def remote_root_context(
    tracer: trace.Tracer, ids: DerivedIds, ctx: context_api.Context, flags: TraceFlags | None = None
) -> context_api.Context:
    """``ctx`` with the coordinator's (not yet seen) root span as remote parent.

    Sampled as the root is: ``flags``, the decision already taken for it, else
    the tracer's :func:`sampling_flags`.
    """
    flags = sampling_flags(tracer, ids.trace_id) if flags is None else flags
    parent = SpanContext(ids.trace_id, ids.root_span_id, is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(parent), ctx)
