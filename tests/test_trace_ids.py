"""Trace ids every rank derives alike, without talking to the others."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, MutableMapping

import pytest
import torch.distributed.checkpoint.logger as torch_logger
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)

import dcp_otel
from dcp_otel import semconv
from dcp_otel.tracing.trace_ids import (
    CheckpointKey,
    SequenceCounter,
    chosen_ids_tracer,
    derive_ids,
    remote_root_context,
    resolve_run_id,
    sampling_flags,
    start_root_span,
    static_sampling_flags,
)

KEY = CheckpointKey("run-a", "0", "save", "/ckpt/step-10")


def test_ids_are_a_pure_function_of_key_and_sequence() -> None:
    assert derive_ids(KEY, 0) == derive_ids(CheckpointKey(*KEY), 0)
    assert derive_ids(KEY, 0) != derive_ids(KEY, 1)
    for changed in (KEY._replace(run_id="run-b"), KEY._replace(restart_count="1"),
                    KEY._replace(operation="load"), KEY._replace(checkpoint_id="/ckpt/step-20")):  # fmt: skip
        assert derive_ids(changed, 0).trace_id != derive_ids(KEY, 0).trace_id
    ids = derive_ids(KEY, 0)
    assert 0 < ids.trace_id < 2**128 and 0 < ids.root_span_id < 2**64


def test_sequence_numbers_count_per_operation_and_checkpoint() -> None:
    counter = SequenceCounter()
    assert [counter.next(KEY) for _ in range(3)] == [0, 1, 2]
    assert counter.next(KEY._replace(operation="load")) == 0


def test_the_sequence_table_is_bounded_and_keeps_the_ids_in_use() -> None:
    """A job saves to a new id every time: the table forgets the oldest, never the id it keeps reusing."""
    counter = SequenceCounter(max_keys=100)
    latest = KEY._replace(checkpoint_id="/ckpt/latest")
    for step in range(2_200):
        counter.next(KEY._replace(checkpoint_id=f"/ckpt/step-{step}"))
        if step % 50 == 0:
            counter.next(latest)
    assert len(counter) == 100
    assert counter.next(latest) == 44  # saved 44 times before, never forgotten
    assert counter.next(KEY._replace(checkpoint_id="/ckpt/step-2199")) == 1  # recent: remembered
    assert counter.next(KEY._replace(checkpoint_id="/ckpt/step-0")) == 0  # long forgotten: starts again
    assert len(counter) == 100


@pytest.mark.parametrize(
    ("env", "explicit", "world", "expected"),
    [
        ({"TORCHELASTIC_RUN_ID": "elastic-1", "SLURM_JOB_ID": "9"}, "mine", 4, ("mine", "option")),
        ({"TORCHELASTIC_RUN_ID": "elastic-1", "SLURM_JOB_ID": "9"}, None, 4, ("elastic-1", "TORCHELASTIC_RUN_ID")),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "2"}, None, 4, ("slurm-9.2", "SLURM_JOB_ID")),
        ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, None, 4, ("10.0.0.1:29500", "fallback")),
    ],
)
def test_run_id_sources_in_order(monkeypatch: pytest.MonkeyPatch, env, explicit, world, expected) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tuple(resolve_run_id(explicit, world)) == expected


def test_a_single_process_without_run_id_gets_a_random_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    identity = resolve_run_id(None, 1)
    assert identity.source == "random" and len(identity.run_id) == 32


def test_root_span_gets_exactly_the_derived_ids_and_the_next_span_does_not() -> None:
    tracer = TracerProvider().get_tracer("t")
    id_generator = tracer.id_generator
    twin = chosen_ids_tracer(tracer)
    assert twin is not None
    ids = derive_ids(KEY, 0)

    root = start_root_span(*twin, ids, semconv.SPAN_CHECKPOINT, context_api.Context())
    other = twin[0].start_span("unrelated")

    assert tracer.id_generator is id_generator  # the provider's tracer is untouched
    assert root.instrumentation_scope == other.instrumentation_scope == tracer.start_span("x").instrumentation_scope

    assert (root.get_span_context().trace_id, root.get_span_context().span_id) == ids
    assert root.parent is None
    assert other.get_span_context().trace_id != ids.trace_id
    assert other.get_span_context().span_id != ids.root_span_id


def test_a_ratio_sampler_keeps_or_drops_a_checkpoint_on_all_ranks_alike() -> None:
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.5)))
    tracer = provider.get_tracer("t")
    twin = chosen_ids_tracer(tracer)
    assert twin is not None
    decisions = []
    for seq in range(64):
        ids = derive_ids(KEY, seq)
        coordinator = start_root_span(*twin, ids, semconv.SPAN_CHECKPOINT, context_api.Context())
        other_rank = tracer.start_span("dcp.save", context=remote_root_context(tracer, ids, context_api.Context()))
        assert other_rank.get_span_context().trace_id == ids.trace_id
        assert other_rank.is_recording() == coordinator.is_recording(), seq
        decisions.append(coordinator.is_recording())
    assert any(decisions) and not all(decisions)  # both outcomes were exercised


def test_non_coordinators_parent_to_the_coordinators_root_span_id() -> None:
    tracer = TracerProvider().get_tracer("t")
    ids = derive_ids(KEY, 3)
    span = tracer.start_span("dcp.save", context=remote_root_context(tracer, ids, context_api.Context()))
    assert span.parent is not None and span.parent.span_id == ids.root_span_id and span.parent.is_remote
    assert isinstance(trace.get_current_span(), trace.NonRecordingSpan)  # nothing leaked into the context


def test_a_store_that_cannot_agree_on_a_generation_is_asked_once_per_process_group_and_counted(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import dcp_otel
    from dcp_otel import _selftelemetry
    from dcp_otel.tracing import trace_ids

    class Unreachable:
        asked = 0

        def compare_set(self, *args: object) -> bytes:
            Unreachable.asked += 1
            raise RuntimeError("store connection refused")

    monkeypatch.delenv(semconv.ENV_GENERATION, raising=False)
    monkeypatch.setattr(trace_ids, "_generation", None)
    _selftelemetry.reset()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(distributed_c10d, "_get_default_store", Unreachable)
        assert [trace_ids.round_generation() for _ in range(3)] == ["", "", ""]  # the checkpoint goes on
        assert Unreachable.asked == 1  # not a store round trip per operation
        assert dcp_otel.diagnostics()["no_generation"] == 1
    finally:
        dist.destroy_process_group()
        trace_ids._generation = None


@pytest.mark.parametrize("sampler", [None, ALWAYS_ON, ALWAYS_OFF, DEFAULT_OFF, ParentBased(ALWAYS_OFF)])
def test_a_constant_sampler_is_asked_once_and_says_what_it_would_say_for_every_trace_id(
    sampler: Sampler | None,
) -> None:
    tracer = (TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()).get_tracer("t")
    flags = static_sampling_flags(tracer)
    assert flags is not None
    assert {sampling_flags(tracer, derive_ids(KEY, seq).trace_id) for seq in range(32)} == {flags}


@pytest.mark.parametrize("sampler", [TraceIdRatioBased(0.5), ParentBasedTraceIdRatio(0.5)])
def test_a_sampler_that_looks_at_the_trace_id_is_asked_per_checkpoint(sampler: Sampler) -> None:
    assert static_sampling_flags(TracerProvider(sampler=sampler).get_tracer("t")) is None


class _CountingEnviron(MutableMapping[str, str]):
    """``os.environ`` that counts the variables read through it."""

    def __init__(self, real: MutableMapping[str, str]) -> None:
        self.real, self.reads = real, 0

    def __getitem__(self, name: str) -> str:
        self.reads += 1
        return self.real[name]

    def __setitem__(self, name: str, value: str) -> None:
        self.real[name] = value

    def __delitem__(self, name: str) -> None:
        del self.real[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)


def test_an_operation_start_reads_the_environment_once_per_process_not_per_save(
    monkeypatch: pytest.MonkeyPatch, traced
) -> None:  # type: ignore[no-untyped-def]
    """What a process is started with (run id, restart count, rank) is read at its first operation."""
    monkeypatch.setenv(semconv.ENV_TORCHELASTIC_RUN_ID, "job-7")
    monkeypatch.setenv(semconv.ENV_TORCHELASTIC_RESTART_COUNT, "2")
    environ = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    tap = torch_logger._dcp_logger

    def operation(checkpoint_id: str) -> None:  # the records DCP logs for a save without a process group
        call, now = uuid.uuid4().hex, 1_700_000_000_000_000_000
        tap.feed({"event": "start", "func_name": "save", "uuid": call, "time": now, "checkpoint_id": checkpoint_id})
        tap.feed({"event": "end", "func_name": "save", "uuid": call, "time": now + 1_000, "checkpoint_id": checkpoint_id})

    operation("/ckpt/step-1")
    assert environ.reads > 0  # the first operation reads what it needs
    monkeypatch.setenv(semconv.ENV_TORCHELASTIC_RUN_ID, "job-8")  # a process's environment does not change: ignored
    environ.reads = 0
    operation("/ckpt/step-2")
    operation("/ckpt/step-3")
    assert environ.reads == 0
    dcp_otel.flush(timeout_s=10)
    saves = [span for span in traced.spans() if span.name == "dcp.save"]
    assert len(saves) == 3
    assert {span.attributes[semconv.ATTR_RUN_ID] for span in saves} == {"job-7"}
    assert len({span.trace_id for span in saves}) == 3  # still a trace per checkpoint


@pytest.mark.parametrize("explicit", ["round-3", None], ids=["set by dcp-otel-run", "agreed through the store"])
def test_in_a_job_an_operation_start_derives_the_generation_once_and_leaves_the_exemplar_to_the_builder(
    monkeypatch: pytest.MonkeyPatch, traced, tmp_path, explicit: str | None
) -> None:  # type: ignore[no-untyped-def]
    """With torch.distributed initialized, what a save's start derives per process group is derived once:
    no environment read, no import statement per save; the metrics' exemplar is made off the caller's thread."""
    import builtins
    import threading

    import torch.distributed as dist
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from dcp_otel.tracing import records, trace_ids

    if explicit is None:
        monkeypatch.delenv(semconv.ENV_GENERATION, raising=False)
    else:
        monkeypatch.setenv(semconv.ENV_GENERATION, explicit)
    monkeypatch.setattr(trace_ids, "_generation", None)
    environ = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    imports: list[object] = []
    real_import = builtins.__import__

    def counting_import(*args: object, **kwargs: object) -> object:
        imports.append(args[0])
        return real_import(*args, **kwargs)  # type: ignore[arg-type]

    made_on: list[str] = []
    real_exemplar = records.exemplar_for_context

    def exemplar_for_context(*args: object, **kwargs: object) -> object:
        made_on.append(threading.current_thread().name)
        return real_exemplar(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(records, "exemplar_for_context", exemplar_for_context)
    tap = torch_logger._dcp_logger
    fields = {"func_name": "save", "pg_name": "None", "backend": "gloo", "world_size": "1", "group_size": "1",
              "global_rank": "0", "local_rank": "0"}  # fmt: skip  (torch's own, as strings)

    def operation(checkpoint_id: str) -> None:
        call, now = uuid.uuid4().hex, 1_700_000_000_000_000_000
        tap.feed({**fields, "event": "start", "uuid": call, "time": now, "checkpoint_id": checkpoint_id})
        tap.feed({**fields, "event": "end", "uuid": call, "time": now + 1_000, "checkpoint_id": checkpoint_id})

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        operation("/ckpt/step-1")
        monkeypatch.setenv(semconv.ENV_GENERATION, "round-4")  # a process's environment does not change: ignored
        environ.reads = 0
        builtins.__import__ = counting_import  # (monkeypatch's own restore imports)
        try:
            operation("/ckpt/step-2")
            operation("/ckpt/step-3")
        finally:
            builtins.__import__ = real_import
        assert (environ.reads, imports) == (0, [])
        assert threading.current_thread().name not in made_on  # not the caller's work
        dcp_otel.flush(timeout_s=10)
    finally:
        dist.destroy_process_group()
        trace_ids._generation = None
    saves = [span for span in traced.spans() if span.name == "dcp.save"]
    assert len(saves) == 3
    generations = {span.attributes[semconv.ATTR_GENERATION] for span in saves}
    assert len(generations) == 1 and (explicit is None or generations == {explicit})
    assert made_on and threading.current_thread().name not in made_on
    exposition = generate_latest(traced.registry).decode()
    exemplars = {sample.exemplar.labels["trace_id"] for family in text_string_to_metric_families(exposition)
                 for sample in family.samples if sample.exemplar is not None}  # fmt: skip
    assert exemplars and exemplars <= {span.trace_id for span in saves}
