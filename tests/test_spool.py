"""The write-ahead record and its survivor, in one process: what a death leaves, and who reports it, once.

The deaths themselves are in test_endings.py (one process, plain vs instrumented) and test_survivors.py
(torchrun). Here: what the record holds while a save runs and after it ends, what a survivor makes of
it, that two survivors report a death once, that a survivor that died mid-report is taken over, that a
forked child never writes into its parent's record, that the spool is private, and what a clean exit
leaves (nothing).
"""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import dcp_otel
from dcp_otel import semconv
from dcp_otel.spool import delivery as delivery_module
from dcp_otel.spool import layout
from dcp_otel.spool.delivery import Delivery
from dcp_otel.spool.reader import Death, read_record
from dcp_otel.spool.record import open_spool_dir
from dcp_otel.spool.survivor import Survivor
from dcp_otel.tracing.flushing import BoundedFlush
from tests.conftest import Traced
from tests.exporters import GatedExporter
from tests.ranks import REPO, rank_env


class Blocked(dcp.FileSystemWriter):
    """``write_data`` waits for ``release``, having said it started."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.started, self.release, self.saved = threading.Event(), threading.Event(), threading.Event()

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.started.set()
        self.release.wait(30)
        return super().write_data(plan, planner)


@pytest.fixture
def spool() -> Path:
    return Path(os.environ[semconv.ENV_SPOOL_DIR])


@pytest.fixture
def blocked(traced: Traced, tmp_path: Path) -> Iterator[Blocked]:
    """A save on another thread, blocked in write_data until the test releases it."""
    writer = Blocked(str(tmp_path / "step-7"))
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "step-6"))  # a finished one first
    assert dcp_otel.flush()  # (its recovery point is the builder's to write, off this thread: written before it is read)

    def save() -> None:
        dcp.save({"w": torch.ones(4)}, storage_writer=writer)
        writer.saved.set()

    worker = threading.Thread(target=save)
    worker.start()
    assert writer.started.wait(30)
    yield writer
    writer.release.set()
    worker.join(30)


def own_record(spool: Path) -> Path:
    (name,) = [n for n in os.listdir(spool) if (parsed := layout.parse_name(n)) and not parsed.state
               and parsed.pid == os.getpid()]  # fmt: skip
    return spool / name


def test_the_record_holds_the_open_save_and_its_step_with_the_ids_the_process_chose(spool: Path, blocked: Blocked,
                                                                                   traced: Traced) -> None:  # fmt: skip
    record = read_record(str(own_record(spool)))
    assert record.identity["pid"] == os.getpid() and record.recovery_id.endswith("step-6")
    (op,) = record.open_ops()
    assert [e.name for e in record.open_entries(op)] == ["save", "write_data"]
    spans = {s.name: s for s in record.spans(Death.of_status(-9, time.time_ns()))
             if s.context.trace_id == op.trace_id or s.name == semconv.SPAN_PROCESS}  # fmt: skip
    assert spans["dcp.write_data"].status.description == "terminated by SIGKILL during write_data"
    assert spans["dcp.process"].attributes[semconv.ATTR_ENDED_BY] == "SIGKILL"
    # The ids are those of the spans the process makes when the save ends: one span, whoever sends it.
    blocked.release.set()
    assert blocked.saved.wait(30)
    dcp_otel.flush()
    built = {s.name: s for s in traced.exporter.get_finished_spans() if s.context.trace_id == op.trace_id}
    for name in ("dcp.save", "dcp.write_data", "dcp.checkpoint"):
        assert spans[name].context.span_id == built[name].context.span_id, name
        assert spans[name].parent == built[name].parent, name


def test_a_finished_save_leaves_nothing_open_and_a_clean_exit_leaves_no_record(spool: Path, tmp_path: Path) -> None:
    script = f"""
import os, torch, dcp_otel
import torch.distributed.checkpoint as dcp
dcp_otel.instrument()
dcp.save({{"w": torch.ones(4)}}, checkpoint_id={str(tmp_path / "c")!r})
print(sorted(os.listdir({str(spool)!r})))
"""
    done = subprocess.run([sys.executable, "-c", script], env=rank_env(), capture_output=True, text=True, timeout=120,
                          cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("['"), done.stdout  # while it ran: its record
    assert os.listdir(spool) == []  # after a normal exit, with every span sent: nothing


def test_two_survivors_report_a_death_once(spool: Path, blocked: Blocked) -> None:
    record = own_record(spool)
    copy = spool / layout.directory_name(layout.host_name(), 999_999, 1)  # a "dead" process: no such pid runs
    copy.mkdir()
    (copy / layout.RECORD_FILE).write_bytes((record / layout.RECORD_FILE).read_bytes())
    sent: list[list[ReadableSpan]] = [[], []]
    survivors = [Survivor(str(spool), lambda spans, i=i: sent[i].extend(spans) or True, job=None) for i in range(2)]
    for survivor in survivors:
        survivor.expect({(999_999, 1): -9}, time.time_ns())
    threads = [threading.Thread(target=survivor.scan) for survivor in survivors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(bool(spans) for spans in sent) == [False, True]  # one of them, once
    assert (spool / f"{copy.name}.{layout.REPORTED}" / layout.DEATH_FILE).exists()


def test_a_claim_left_by_a_dead_survivor_is_taken_over(spool: Path, blocked: Blocked) -> None:
    record = own_record(spool)
    claimed = spool / f"{layout.directory_name(layout.host_name(), 999_998, 1)}.{layout.CLAIMED}.999997.1"
    claimed.mkdir()  # claimed by a survivor that died before it sent anything
    (claimed / layout.RECORD_FILE).write_bytes((record / layout.RECORD_FILE).read_bytes())
    sent: list[ReadableSpan] = []
    survivor = Survivor(str(spool), lambda spans: sent.extend(spans) or True, job=None)
    survivor.expect({(999_998, 1): -15}, time.time_ns())
    assert survivor.scan() == 1 and any(s.name == "dcp.write_data" for s in sent)


def test_a_survivor_that_cannot_send_claims_nothing_and_the_record_stays(spool: Path, blocked: Blocked) -> None:
    record = own_record(spool)
    dead = spool / layout.directory_name(layout.host_name(), 999_996, 1)
    dead.mkdir()
    (dead / layout.RECORD_FILE).write_bytes((record / layout.RECORD_FILE).read_bytes())

    def refuse(spans: Sequence[ReadableSpan]) -> bool:
        return False  # an exporter that fails

    survivor = Survivor(str(spool), refuse, job=None)
    survivor.expect({(999_996, 1): -9}, time.time_ns())
    assert survivor.scan() == 0 and dead.exists()  # for another survivor, or dcp-otel report


def plant(spool: Path, host: str, pid: int, start: int, **identity: object) -> Path:
    """A record of a process ``pid`` (started at ``start``, on ``host``), the test process's own record made over."""
    from dcp_otel.spool.record import ProcessRecord

    data = bytearray((own_record(spool) / layout.RECORD_FILE).read_bytes())
    record = read_record(str(own_record(spool)))
    ProcessRecord._write_json(data, layout.OFF_IDENTITY, {**record.identity, "pid": pid, **identity},
                              layout.IDENTITY_MAX)  # fmt: skip
    path = spool / layout.directory_name(host, pid, start)
    path.mkdir()
    (path / layout.RECORD_FILE).write_bytes(data)
    return path


def test_a_pid_names_a_death_only_with_its_start_its_namespace_and_its_parent(spool: Path, blocked: Blocked) -> None:
    """A pid is reused, and means a process only in its pid namespace: a survivor told that (pid, start) died
    reports that record alone; one in another namespace (another container on the same spool) it never judges;
    a record whose parent had this pid but not this start (a parent of an earlier job) is no child of its."""
    planted = functools.partial(plant, spool)
    me, my_start = os.getpid(), layout.start_ticks(os.getpid())
    reused = planted(layout.host_name(), 999_990, 2)  # the pid again, another process (another start)
    elsewhere = planted("other-4026532000", 999_991, 1)  # the same pid and start, in another namespace
    earlier_parent = planted(layout.host_name(), 999_992, 1, ppid=me, parent_start=(my_start or 0) + 1)
    child = planted(layout.host_name(), 999_993, 1, ppid=me, parent_start=my_start)
    sent: list[ReadableSpan] = []
    survivor = Survivor(str(spool), lambda spans: sent.extend(spans) or True, job=None)
    survivor.expect({(999_990, 1): -9, (999_991, 1): -9, (999_992, None): -9, (999_993, None): -9}, time.time_ns())
    assert survivor.scan() == 1
    assert reused.exists() and elsewhere.exists() and earlier_parent.exists() and not child.exists()
    assert sent and {s.resource.attributes.get("process.pid") for s in sent} == {999_993}


def test_the_deaths_seen_in_one_look_go_out_in_one_delivery_so_an_exporter_stuck_on_one_holds_back_none(
        spool: Path, blocked: Blocked) -> None:  # fmt: skip
    """A node's ranks die together. Sent one record at a time, an exporter stuck on the first (a collector down
    for a while) had the others refused, not handed over on top of it, and left for a retry 30 s later: an agent
    that exits meanwhile sent one rank of two (found by a review). Sent together, what the exporter takes once it
    is back is every rank's; the records stay for another try, the delivery not confirmed in time."""
    dead = [plant(spool, layout.host_name(), pid, 1) for pid in (999_970, 999_971, 999_972)]
    exporter, deliveries = GatedExporter(), []
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    delivery = Delivery(lambda: provider, timeout_s=0.5)
    try:
        survivor = Survivor(str(spool), lambda spans: deliveries.append(len(spans)) or delivery(spans), job=None)
        survivor.expect({(999_970, 1): -9, (999_971, 1): -9, (999_972, 1): -9}, time.time_ns())
        assert survivor.scan() == 0  # (the exporter is stuck: not confirmed within the delivery's timeout)
        assert len(deliveries) == 1 and all(path.exists() for path in dead)  # for another try, and the report
        exporter.gate.set()  # the collector is back
        assert provider.force_flush()
        assert {s.resource.attributes.get("process.pid") for s in exporter.got} == {999_970, 999_971, 999_972}
        assert len(exporter.got) == deliveries[0]
    finally:
        exporter.gate.set()
        provider.shutdown()


def test_a_delivery_hands_over_no_more_than_half_a_batch_processors_queue_between_flushes(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A dead process's record may hold thousands of spans (a process whose exporter was stuck keeps up to 4 MiB).
    A batch processor drops the oldest of what overflows its queue: handed over at once, a record larger than the
    queue lost its first spans, the checkpoint's root among them. The delivery hands them over half a queue at a
    time (``OTEL_BSP_MAX_QUEUE_SIZE``), flushing between; the exporter here takes nothing until the first flush
    begins, so the queue is full at that moment, not by chance."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    exporter = GatedExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))

    class Opening(BoundedFlush):  # the collector answers from the first flush on
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            exporter.gate.set()
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(delivery_module, "BoundedFlush", Opening)
    tracer = TracerProvider().get_tracer("dead process")
    spans = []
    for n in range(21):
        span = tracer.start_span(f"span {n}")
        span.end()
        spans.append(span)
    try:
        assert Delivery(lambda: provider, timeout_s=30)(spans) is True
        assert [s.name for s in exporter.got] == [s.name for s in spans]  # every one, in order
    finally:
        exporter.gate.set()
        provider.shutdown()


@pytest.mark.parametrize("direct", [True, False])
def test_the_agents_delivery_goes_straight_to_its_exporters_and_tries_a_failed_export_again_until_its_deadline(
        direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The SDK's batch processor says its flush succeeded whatever its exporter answered: through the agent's
    provider, a collector down for longer than the OTLP exporter's retries (about 7 s of a 10 s timeout) lost a dead
    rank's spans, counted sent (a review: down for 8 s, none of two ranks' arrived). The agent's delivery
    (``direct``) sends to the exporters the environment names, knows each answer, and tries a failed export again
    until its deadline; a rank's keeps its provider, whose exporters may be its own, set in code."""
    monkeypatch.setattr(delivery_module, "REFUSED_BELOW_S", 0.0)  # (these fail at once; OTLP's after its own retries)
    provider, through_provider = TracerProvider(), GatedExporter()
    provider.add_span_processor(BatchSpanProcessor(through_provider))
    back_after_two = GatedExporter(fails=2)  # (a collector that answers 503 twice, then takes them)
    back_after_two.gate.set()
    through_provider.gate.set()
    span = TracerProvider().get_tracer("dead rank").start_span("dcp.write_data")
    span.end()
    try:
        sent = Delivery(lambda: provider, timeout_s=30, direct=direct, exporters=[back_after_two])([span])
        provider.force_flush()
        if direct:
            assert sent is True and back_after_two.exports == 3 and [s.name for s in back_after_two.got] == [span.name]
            assert not through_provider.got  # (not twice: the provider's exporters are the environment's)
        else:  # through the provider: its flush ended, which is all the SDK says
            assert sent is True and [s.name for s in through_provider.got] == [span.name] and not back_after_two.exports
        again = GatedExporter(fails=2)
        again.gate.set()
        assert Delivery(TracerProvider, timeout_s=30, direct=direct, exporters=[again])([span]) is direct  # (no processors: the exporters either way; tried again only directly)
    finally:
        provider.shutdown()


def test_the_agents_delivery_does_not_try_again_an_export_refused_at_once() -> None:
    """An OTLP exporter retries for seconds what may pass (503, a connection refused) and fails at once on what never
    will (a 400). Tried again until the deadline, a rejection made 20 requests, logged 20 lines and held the agent's
    exit 10 s (a review); an export that fails at once is not tried again."""
    span = TracerProvider().get_tracer("dead rank").start_span("dcp.write_data")
    span.end()
    rejecting = GatedExporter(refuses=True)
    assert Delivery(TracerProvider, timeout_s=30, direct=True, exporters=[rejecting])([span]) is False
    assert rejecting.exports == 1
    # One that raises met no collector (OTLP/HTTP before 1.45 raises a refused connection at once): tried again.
    unreachable = GatedExporter(raises=2)
    unreachable.gate.set()
    assert Delivery(TracerProvider, timeout_s=30, direct=True, exporters=[unreachable])([span]) is True
    assert unreachable.exports == 3 and len(unreachable.got) == 1


def test_the_agents_export_requests_make_no_spans_of_their_own() -> None:
    """Exported as the SDK's processors export, with instrumentation suppressed: an instrumented HTTP client
    (``opentelemetry-bootstrap`` installs ``requests``' and ``urllib3``'s) would make a span of each request."""
    from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_value

    suppressed: list[object] = []

    class Watching(GatedExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> Any:
            suppressed.append(get_value(_SUPPRESS_INSTRUMENTATION_KEY))
            return super().export(spans)

    exporter = Watching()
    exporter.gate.set()
    span = TracerProvider().get_tracer("dead rank").start_span("dcp.write_data")
    span.end()
    assert Delivery(TracerProvider, timeout_s=30, direct=True, exporters=[exporter])([span]) is True
    assert suppressed == [True]


def test_the_spans_sent_late_that_are_remembered_are_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    """What late exports sent is remembered up to a bound; past it the oldest go. A first version replaced the whole
    set when it overflowed, and dropped spans still to be handed over again (a review: sent twice)."""
    monkeypatch.setattr(delivery_module, "_SENT_LATE_MAX", 3)
    tracer = TracerProvider().get_tracer("dead rank")
    a, b, c = ([tracer.start_span(f"{n}{i}") for i in range(k)] for n, k in (("a", 2), ("b", 2), ("c", 1)))
    for span in (*a, *b, *c):
        span.end()
    gates = [threading.Event() for _ in range(3)]

    class Late(GatedExporter):  # each export stuck past its delivery's deadline, then through
        def export(self, spans: Sequence[ReadableSpan]) -> Any:
            gate = gates[min(self.exports, 2)]
            self.exports += 1
            gate.wait(60)
            self.got.extend(spans)
            return delivery_module.SpanExportResult.SUCCESS

    exporter = Late()
    delivery = Delivery(TracerProvider, timeout_s=0.5, direct=True, exporters=[exporter])
    try:
        for spans, gate in ((a, gates[0]), (b, gates[1]), (c, gates[2])):
            assert delivery(spans) is False  # (its export gets through after the deadline)
            gate.set()
        assert delivery([*b, *c]) is True and exporter.exports == 3  # remembered: none sent again
        assert delivery(a[:1]) is True and exporter.exports == 4  # the oldest, forgotten: sent again
    finally:
        for gate in gates:
            gate.set()


def test_spans_an_export_sent_after_its_deadline_are_not_sent_again_with_the_next_delivery() -> None:
    """An exporter retries on its own clock: an export the delivery's deadline gave up on may still get through,
    after the delivery said it had not, and the spans are handed over again (the record's lines, the death tried
    again). Sent twice, a review counted 19 duplicates for a collector down 13 s; they are left out of the next
    delivery, which sends only what is new. That delivery waits, within its own time, for the export still under way
    (refused at once, the ranks' last spans at a job's end were left behind by the agent's exit)."""
    tracer = TracerProvider().get_tracer("dead rank")
    first, later = tracer.start_span("dcp.write_data"), tracer.start_span("dcp.process")
    first.end()
    later.end()
    exporter = GatedExporter()  # (stuck until the gate: past the delivery's deadline)
    delivery = Delivery(TracerProvider, timeout_s=2, direct=True, exporters=[exporter])
    try:
        assert delivery([first]) is False  # the deadline came first
        exporter.gate.set()  # then the export gets through, as the next delivery begins
        assert delivery([first, later]) is True
        assert [s.name for s in exporter.got] == ["dcp.write_data", "dcp.process"]  # each once
    finally:
        exporter.gate.set()


def test_a_dead_record_is_read_once_however_often_the_survivor_looks_and_is_still_judged_anew(
        spool: Path, blocked: Blocked, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Every rank looks every second; other jobs' dead records stay for a week. Read again each look, 13 of them
    cost a rank 7 ms of CPU a second (benchmarks/own_share.py); a dead process writes nothing more, so its
    record is read once, and what the survivor learns later (how it died) still decides."""
    import dcp_otel.spool.survivor as survivor_module

    data = (own_record(spool) / layout.RECORD_FILE).read_bytes()
    dead = spool / layout.directory_name(layout.host_name(), 999_989, 1)
    dead.mkdir()
    (dead / layout.RECORD_FILE).write_bytes(data)
    reads: list[str] = []

    def counted(path: str):  # type: ignore[no-untyped-def]
        reads.append(os.path.basename(path))
        return read_record(path)

    monkeypatch.setattr(survivor_module, "read_record", counted)
    sent: list[ReadableSpan] = []
    survivor = Survivor(str(spool), lambda spans: sent.extend(spans) or True, job="another job")
    assert [survivor.scan() for _ in range(5)] == [0] * 5  # not its job's: left alone
    assert reads == [dead.name] and dead.exists()
    survivor.expect({(999_989, 1): -9}, time.time_ns())  # then told how it died: its to report
    assert survivor.scan() == 1 and sent
    assert not dead.exists() and (spool / f"{dead.name}.{layout.REPORTED}" / layout.DEATH_FILE).exists()


def test_a_process_is_dead_only_on_evidence_and_a_record_that_failed_to_read_is_read_again(
        spool: Path, blocked: Blocked, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A read of /proc that fails for want of file descriptors says nothing: a survivor that took it for a death
    would report a live process (and, caching what it saw dead, never look again). A record that fails to read
    once (another survivor has it claimed for a moment) is read at the next look."""
    import builtins

    import dcp_otel.spool.survivor as survivor_module

    me, start = os.getpid(), layout.start_ticks(os.getpid()) or 0
    real_open = builtins.open

    def no_descriptors(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).startswith("/proc/"):
            raise OSError(24, "Too many open files")
        return real_open(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(builtins, "open", no_descriptors)
        assert layout.alive(me, start)  # unknown: alive
    assert layout.alive(me, start) and not layout.alive(me, start + 1) and not layout.alive(999_987, 1)

    data = (own_record(spool) / layout.RECORD_FILE).read_bytes()
    dead = spool / layout.directory_name(layout.host_name(), 999_986, 1)
    dead.mkdir()
    (dead / layout.RECORD_FILE).write_bytes(data)
    failures = [True]

    def once_unreadable(path: str):  # type: ignore[no-untyped-def]
        if failures and os.path.basename(path) == dead.name:
            failures.pop()
            raise survivor_module.RecordError(f"{path}: no record (claimed by another survivor)")
        return read_record(path)

    monkeypatch.setattr(survivor_module, "read_record", once_unreadable)
    sent: list[ReadableSpan] = []
    survivor = Survivor(str(spool), lambda spans: sent.extend(spans) or True, job=None)
    survivor.expect({(999_986, 1): -9}, time.time_ns())
    assert survivor.scan() == 0 and not failures and not sent
    assert survivor.scan() == 1 and sent


def test_the_spool_never_holds_up_uninstrument_on_a_stuck_flush_and_outlives_an_exporters_system_exit(
        spool: Path, traced: Traced, tmp_path: Path) -> None:  # fmt: skip
    """The confirming thread flushes the provider itself: a flush that never returns is not waited for at stop;
    one that raises SystemExit (an exporter's) leaves the thread confirming the next checkpoints."""
    keep = dcp_otel.DCPInstrumentor()._spool.keep  # type: ignore[union-attr]
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "first"))
    assert dcp_otel.flush() and keep.wait_idle(30)
    calls, release, flushing = [], threading.Event(), threading.Event()
    provider = traced.provider
    original = provider.force_flush

    def exiting(timeout_millis: int = 30_000) -> bool:
        calls.append("exit")
        raise SystemExit(3)

    provider.force_flush = exiting  # type: ignore[method-assign]
    try:
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "exits"))
        assert traced.recorder().drain(30) and keep.wait_idle(30) and calls == ["exit"]
        assert keep.unconfirmed  # (not confirmed: the flush said nothing)

        def stuck(timeout_millis: int = 30_000) -> bool:
            flushing.set()
            release.wait(60)
            return original(timeout_millis)

        provider.force_flush = stuck  # type: ignore[method-assign]
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "stuck"))  # the same thread flushes again
        assert flushing.wait(30)
        stopped = threading.Event()
        threading.Thread(target=lambda: (keep.stop(60), stopped.set()), daemon=True).start()
        assert stopped.wait(30) and not release.is_set()  # stop() did not wait for the stuck flush
    finally:
        release.set()
        provider.force_flush = original  # type: ignore[method-assign]


def test_checkpoints_closer_than_the_gap_share_one_export_request_and_the_next_one_goes_out_after_it(
        spool: Path, traced: Traced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Each of the confirming thread's flushes is an export request beside the training steps: checkpoints less than
    MIN_GAP_S apart share one, and every span is confirmed all the same once it has gone out."""
    import dcp_otel.spool.spans as spans_module

    keep = dcp_otel.DCPInstrumentor()._spool.keep  # type: ignore[union-attr]
    monkeypatch.setattr(spans_module, "MIN_GAP_S", 3.0)  # (two tiny saves take a few ms: far less)
    provider, flushes = traced.provider, []
    original = provider.force_flush

    def counted(timeout_millis: int = 30_000) -> bool:
        if threading.current_thread().name == "dcp-otel-spool-confirm":
            flushes.append(time.monotonic())
        return original(timeout_millis)

    provider.force_flush = counted  # type: ignore[method-assign]
    try:
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "first"))
        assert traced.recorder().drain(30) and keep.wait_idle(30) and len(flushes) == 1 and not keep.unconfirmed
        for name in ("second", "third"):
            dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / name))
        assert traced.recorder().drain(30) and keep.wait_idle(30)
        assert len(flushes) == 2 and not keep.unconfirmed  # both in one request, and confirmed
        assert flushes[1] - flushes[0] >= 3.0  # (after the gap, not before)
        assert len(traced.exporter.get_finished_spans()) > 0
    finally:
        provider.force_flush = original  # type: ignore[method-assign]


def test_a_flush_drops_the_lines_it_confirmed_though_more_were_kept_while_it_ran(tmp_path: Path) -> None:
    """Checkpoints back to back keep lines while a flush runs: the lines it confirmed leave the file all the same,
    the later ones stay (a file emptied only when nothing came meanwhile filled its 4 MiB in a soak)."""
    import json
    from types import SimpleNamespace

    from dcp_otel.spool.spans import SpanSpool

    record, meanwhile = SimpleNamespace(directory=str(tmp_path), mm=bytearray(layout.OFF_EXPORTED + 8)), []

    class Provider:
        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            if not meanwhile:  # (once) a checkpoint's spans are kept while this flush runs
                meanwhile.append(keep.add([["meanwhile"]]))
            return True

    provider = Provider()
    keep = SpanSpool(record, lambda: provider, lambda timeout_s: True, timeout_s=10)  # type: ignore[arg-type]
    keep.stop(0)  # (no confirming thread: this one confirms)
    keep.add([["first"]])
    keep.add([["second"]])
    kept = tmp_path / layout.SPANS_FILE
    assert keep.confirm(10) and layout.U64.unpack_from(record.mm, layout.OFF_EXPORTED)[0] == 2
    assert [(line[0], line[2]) for line in map(json.loads, kept.read_text().splitlines())] == [(3, [["meanwhile"]])]
    assert keep.unconfirmed and keep.confirm(10) and kept.read_text() == "" and not keep.unconfirmed
    assert layout.U64.unpack_from(record.mm, layout.OFF_EXPORTED)[0] == 3


def test_a_process_without_a_checkpoint_of_its_own_never_waits_at_exit_on_a_dead_peers_spans(
    spool: Path, blocked: Blocked
) -> None:
    """A process of the job that made no checkpoint (yet) reports a dead peer through its exporter, which hangs:
    its exit waits for none of it (the peer's record stays claimed, for a survivor after it)."""
    from dcp_otel.spool.record import ProcessRecord

    data = bytearray((own_record(spool) / layout.RECORD_FILE).read_bytes())
    identity = {**read_record(str(own_record(spool))).identity, "pid": 999_980, "job": "job-x", "ppid": 1}
    ProcessRecord._write_json(data, layout.OFF_IDENTITY, identity, layout.IDENTITY_MAX)
    peer = spool / layout.directory_name(layout.host_name(), 999_980, 1)
    peer.mkdir()
    (peer / layout.RECORD_FILE).write_bytes(data)
    script = f"""
import os, sys, threading, time
import torch, dcp_otel
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

class Hanging(SpanExporter):
    def export(self, spans):
        threading.Event().wait()

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(Hanging()))
dcp_otel.instrument(tracer_provider=provider)
claimed, tick = ".claimed." + str(os.getpid()) + ".", threading.Event()
while not any(claimed in name for name in os.listdir({str(spool)!r})):
    tick.wait(0.05)  # (polled: its survivor claims the peer's record, then hangs in the exporter)
print(time.time(), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], env=rank_env(DCP_OTEL_RUN_ID="job-x"), capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    ended = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    assert ended - float(done.stdout.strip()) < 3.0, done.stderr[-2000:]  # (its flush timeout: 10 s)
    assert [n for n in os.listdir(spool) if n.startswith(peer.name + "." + layout.CLAIMED)], os.listdir(spool)


def test_a_forked_child_never_writes_into_its_parents_record(spool: Path, traced: Traced, tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "parent"))
    dcp_otel.flush()  # (built: the builder writes no more into the record meanwhile)
    record = own_record(spool)
    before = (record / layout.RECORD_FILE).read_bytes()
    pid = os.fork()
    if pid == 0:  # the child saves: into a record of its own
        try:
            dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "child"))
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert (record / layout.RECORD_FILE).read_bytes()[layout.HEADER_SIZE :] == before[layout.HEADER_SIZE :]
    children = [n for n in os.listdir(spool) if layout.parse_name(n) and layout.parse_name(n).pid == pid]  # type: ignore[union-attr]
    assert len(children) == 1  # its own (left: the child ended with os._exit, as a forked worker does)


def test_the_spool_is_this_users_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="open to other users"):
        open_spool_dir(str(shared))
    made = tmp_path / "made"
    open_spool_dir(str(made))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_an_unusable_spool_is_said_once_and_changes_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  traced: Traced) -> None:  # fmt: skip
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(semconv.ENV_SPOOL_DIR, str(shared))
    dcp_otel.uninstrument()
    dcp_otel.instrument(tracer_provider=traced.provider)
    assert dcp_otel.DCPInstrumentor().spool is None and dcp_otel.diagnostics().get("spool_error") == 1
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "c"))
    assert any(s.name == "dcp.save" for s in traced.spans())


def test_a_save_that_ended_but_was_not_built_yet_is_sent_with_its_own_ends_and_outcome(
    spool: Path, traced: Traced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process killed between a save's end and its build (the builder behind): its spans exist nowhere else."""
    from dcp_otel.tracing.builder import SpanBuilder

    release, building = threading.Event(), threading.Event()
    build = SpanBuilder._build

    def held(self: SpanBuilder, *args: object, **kwargs: object) -> None:
        building.set()
        release.wait(30)
        build(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SpanBuilder, "_build", held)
    try:
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "step-9"))
        assert building.wait(30)
        record = read_record(str(own_record(spool)))
        (op,) = record.unbuilt_ops()
        spans = {s.name: s for s in record.spans(Death.of_status(-9, time.time_ns())) if s.context.trace_id == op.trace_id}
        assert {"dcp.checkpoint", "dcp.save", "dcp.write_data"} <= set(spans)
        assert all(s.status.status_code.name == "UNSET" for s in spans.values())  # it succeeded: no death of its
        assert spans["dcp.save"].end_time == op.end_ns  # its own end, not the death's
    finally:
        release.set()


def _record_with_ops(tmp_path: Path, count: int) -> tuple[object, list[object], object]:
    """A record, ``count`` operations begun in it, and a maker of more."""
    from types import SimpleNamespace

    from opentelemetry.trace import TraceFlags

    from dcp_otel.spool.record import ProcessRecord

    record = ProcessRecord(str(tmp_path / "spool"), lambda: {})

    def op(n: int) -> SimpleNamespace:
        return SimpleNamespace(trace_id=n, span_id=n, root_span_id=0, name="save", flags=TraceFlags(1), adopted=False,
                               attributes={}, step_attributes={}, rec_serial=0, rec_slot=-1, failed=None, end_ns=n,
                               start_uuid=str(n), submitted=False)  # fmt: skip

    ops = [op(n) for n in range(1, count + 1)]
    for o in ops:
        record.op_begin(o, 1, 0)  # type: ignore[arg-type]
    return record, ops, op


def test_operations_left_open_for_good_give_way_to_new_ones_oldest_first(tmp_path: Path) -> None:
    """An operation left open for good, as many times as the record holds: the oldest gives way (counted, said),
    and its late end writes nothing into its successor's slot."""
    from dcp_otel import _selftelemetry

    _selftelemetry.reset()
    record, leaked, op = _record_with_ops(tmp_path, layout.OP_SLOTS)
    newest = op(1000)
    record.op_begin(newest, 1, 0)  # type: ignore[attr-defined]
    assert _selftelemetry.counts().get("spool_operation_evicted") == 1
    assert leaked[0].rec_slot == -1 and newest.rec_slot >= 0  # type: ignore[attr-defined]  # the oldest gave way
    record.op_complete(leaked[0])  # type: ignore[attr-defined]  # its end, late: nowhere
    ops = read_record(str(record.directory)).ops  # type: ignore[attr-defined]
    assert ops[newest.rec_serial].doc["trace"] == 1000 and ops[newest.rec_serial].state == layout.OP_STATE_OPEN
    assert leaked[0].rec_serial not in ops  # type: ignore[attr-defined]


def test_ended_operations_the_builder_has_not_reached_give_way_before_open_ones_unsaid(tmp_path: Path) -> None:
    """A tight loop of state-dict calls outruns the builder by dozens of ended operations: the oldest of those
    gives way (it is still built and exported; only a death in the next moments would lose it), an open one
    keeps its slot, and nothing is said or counted."""
    from dcp_otel import _selftelemetry

    _selftelemetry.reset()
    record, ops, op = _record_with_ops(tmp_path, layout.OP_SLOTS)
    still_open = ops[0]
    for o in ops[1:]:
        record.op_complete(o)  # type: ignore[attr-defined]
    newest = op(1000)
    record.op_begin(newest, 1, 0)  # type: ignore[attr-defined]
    assert ops[1].rec_slot == -1 and still_open.rec_slot >= 0 and newest.rec_slot >= 0  # type: ignore[attr-defined]
    assert "spool_operation_evicted" not in _selftelemetry.counts()


def test_a_start_cut_short_gives_its_operations_slot_back(tmp_path: Path) -> None:
    """An operation begun by a start that an exception cut short never runs (dcp_otel.tracing.cut_short): its
    slot is free again, and a slot a start took without writing (cut short in between) is taken first, unsaid."""
    from dcp_otel import _selftelemetry

    _selftelemetry.reset()
    record, ops, op = _record_with_ops(tmp_path, layout.OP_SLOTS)
    record.abandon("1")  # type: ignore[attr-defined]
    open_serials = {o.serial for o in read_record(str(record.directory)).open_ops()}  # type: ignore[attr-defined]
    assert ops[0].rec_slot == -1 and ops[0].rec_serial not in open_serials and ops[1].rec_serial in open_serials  # type: ignore[attr-defined]
    lost = record._free_ops.pop()  # type: ignore[attr-defined]  # taken, never written: no operation holds it
    newest = op(1000)
    record.op_begin(newest, 1, 0)  # type: ignore[attr-defined]
    assert newest.rec_slot == lost and "spool_operation_evicted" not in _selftelemetry.counts()  # type: ignore[attr-defined]


class CountedSurvivor(Survivor):
    """A survivor whose looks are counted, and waited for."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.looks, self.looked = 0, threading.Condition()

    def scan(self, now_ns: int | None = None) -> int:
        found = super().scan(now_ns)
        with self.looked:
            self.looks += 1
            self.looked.notify_all()
        return found

    def look_after(self, looks: int, timeout_s: float) -> bool:
        with self.looked:
            return self.looked.wait_for(lambda: self.looks > looks, timeout_s)


def _started_inside_a_checkpoint_call(spool: Path) -> tuple[CountedSurvivor, threading.Event]:
    """A started survivor whose process is inside a checkpoint call until ``inside`` is cleared."""
    inside = threading.Event()
    inside.set()
    survivor = CountedSurvivor(str(spool), lambda spans: True, job=None, interval_s=0.05, checkpointing=inside.is_set)
    survivor.start()
    return survivor, inside


def test_a_survivor_does_not_look_while_its_process_is_inside_a_checkpoint_call_unless_a_death_is_expected(
        spool: Path) -> None:  # fmt: skip
    """A look takes the interpreter lock (its first reads every record: 41 ms with 82 of them) from the training
    thread: not while that thread plans or stages a checkpoint. A death it is told of is looked for at once."""
    survivor, inside = _started_inside_a_checkpoint_call(spool)
    try:
        # A bounded wait for what must not happen: 10 intervals without a look.
        assert not survivor.look_after(0, 0.5)
        survivor.expect({(2**22 + 1, 1): -9}, time.time_ns())  # (no such record: a look, and nothing reported)
        assert survivor.look_after(0, 10)
        looks = survivor.looks
        assert not survivor.look_after(looks, 0.5)  # quiet again
        inside.clear()  # the call returned
        assert survivor.look_after(looks, 10)
    finally:
        survivor.stop()


def test_a_survivor_looks_anyway_once_a_checkpoint_call_has_lasted_quiet_max_s(spool: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from dcp_otel.spool import survivor as surviving

    monkeypatch.setattr(surviving, "QUIET_MAX_S", 0.2)
    survivor = CountedSurvivor(str(spool), lambda spans: True, job=None, interval_s=0.05, checkpointing=lambda: True)
    survivor.start()
    try:
        assert survivor.look_after(0, 10)  # a save of minutes does not keep the deaths it outlives unreported
    finally:
        survivor.stop()


def test_a_survivor_held_back_by_a_checkpoint_call_looks_when_the_call_ends_not_at_its_next_look(
        spool: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Looking every 50 ms whether the call had returned cost the training thread a switch of the interpreter lock
    each time (benchmarks/own_share.py): the call's end wakes the survivor (the recorder calls ``nudge``)."""
    from dcp_otel.spool import survivor as surviving

    monkeypatch.setattr(surviving, "QUIET_MAX_S", 60.0)
    monkeypatch.setattr(surviving, "_QUIET_POLL_S", 60.0)
    survivor, inside = _started_inside_a_checkpoint_call(spool)
    try:
        assert not survivor.look_after(0, 0.3)  # (a bounded wait for what must not happen)
        inside.clear()
        survivor.nudge()  # the call returned
        assert survivor.look_after(0, 10)
    finally:
        survivor.stop()


def test_a_record_is_removed_whole_though_a_line_is_being_written_as_it_goes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """At exit dcp-otel's threads are told to stop, not waited for: the builder may be writing a checkpoint's line
    (or the confirming thread dropping lines) as the record is removed. The removal waits for the write, so no
    ``spans.jsonl`` is made again in a directory whose record is gone (which no survivor can read: torchelastic's
    agent waited its whole exit timeout for that rank's death, a flake of ``test_survivors`` on this machine)."""
    import json
    from types import SimpleNamespace

    from dcp_otel.spool import record as record_module
    from dcp_otel.spool import spans
    from dcp_otel.spool.record import ProcessRecord
    from dcp_otel.spool.spans import SpanSpool

    record = ProcessRecord(str(tmp_path / "spool"), lambda: {})
    assert record.ensure() and record.directory is not None
    directory = Path(record.directory)
    keep = SpanSpool(record, lambda: None, lambda timeout_s: True, timeout_s=10)  # type: ignore[arg-type]
    keep.stop(0)
    writing, go_on, written, removing = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def dumps(value: object, **kwargs: object) -> str:  # the line being made, the record's directory read
        writing.set()
        go_on.wait(10)
        return json.dumps(value, **kwargs)  # type: ignore[arg-type]

    def rmtree(path: str, ignore_errors: bool = False) -> None:  # the removal, between its files and its directory
        removing.set()
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        go_on.set()
        written.wait(10)
        try:
            os.rmdir(path)
        except OSError:  # (as shutil.rmtree's ignore_errors: a file made since its listing keeps the directory)
            pass

    monkeypatch.setattr(spans, "json", SimpleNamespace(dumps=dumps, loads=json.loads))
    monkeypatch.setattr(record_module, "shutil", SimpleNamespace(rmtree=rmtree))
    adding = threading.Thread(target=lambda: (keep.add([["late"]]), written.set()))
    adding.start()
    assert writing.wait(10)
    closing = threading.Thread(target=keep.close_record, args=(True,))
    closing.start()
    removing.wait(0.5)  # (a bounded look for what must not happen: the removal starting before the line is written)
    go_on.set()
    adding.join(10)
    closing.join(10)
    assert not directory.exists(), sorted(p.name for p in directory.iterdir())
