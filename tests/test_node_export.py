"""``span_export="node"``: the rank writes its checkpoint spans into its record, the node's agent sends them.

A rank that leaves its spans to the node makes no SDK span for its checkpoints and sends no export request: its
builder writes the spans straight into the record's ``spans.jsonl``, and the survivor of torchelastic's agent sends
them through the agent's exporters, with the rank's resource, and moves the record's mark. The spans that reach the
backend are the ones the rank would have sent itself (ids, parents, statuses, attributes, events, links), each once;
the rank drops what the agent has sent; a rank whose spans nobody sends says so once; a rank that exits before the
agent sent its last spans leaves them for the agent. Real torchrun (2 gloo ranks) under
``opentelemetry-instrument``, a loopback OTLP/HTTP receiver: the same spans reach it as without the option, none of
them through the ranks' own providers, and the job does what it does plain.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import _selftelemetry, semconv
from dcp_otel.instrumentor import DCPInstrumentor
from dcp_otel.spool import layout
from dcp_otel.spool.delivery import Delivery
from dcp_otel.spool.node import NodeExport
from dcp_otel.spool.reader import read_record
from dcp_otel.spool.survivor import Survivor
from tests.otlp_receiver import OtlpReceiver
from tests.ranks import WORKERS, rank_env

JOB = "node-export-test"
BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1"]


class Failing(dcp.FileSystemWriter):
    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        raise OSError("the disk is gone")


def checkpoints(root: Path) -> None:
    """A save, an async save, a failed save and a load, in one process."""
    state = {"w": torch.arange(16.0), "b": torch.ones(4)}
    dcp.save(state, checkpoint_id=str(root / "step-1"))
    dcp.async_save(state, checkpoint_id=str(root / "step-2")).result()
    with pytest.raises(dcp.api.CheckpointException):
        dcp.save(state, storage_writer=Failing(str(root / "step-3")))
    dcp.load({"w": torch.zeros(16), "b": torch.zeros(4)}, checkpoint_id=str(root / "step-2"))
    assert dcp_otel.flush(30)


#: Attributes whose presence depends on which of torch's threads comes first (the async save's staging sync runs beside
#: the save that names the writer), in either mode.
RACED = {("dcp.maybe_synchronize_staging", semconv.ATTR_STORAGE_WRITER)}


def shape(spans: list[ReadableSpan], root: Path) -> list[tuple[Any, ...]]:
    """What a backend shows of each span, the run's own paths and timings aside: name, parent's name, status,
    attributes (numbers of seconds as such), events, links."""
    names = {s.context.span_id: s.name for s in spans}

    def value(key: str, v: Any) -> Any:
        if isinstance(v, str):
            return v.replace(str(root), "ROOT")
        if isinstance(v, float) or "seconds" in key or key.endswith("_s"):
            return "seconds"
        if isinstance(v, (list, tuple)):  # (the slowest keys, and an async save's steps, in the order of their times)
            return sorted(v) if "slowest" in key or "steps.names" in key else list(v)
        return v

    return sorted(json.dumps([s.name, names.get(s.parent.span_id, "remote") if s.parent else None,
                              s.status.status_code.name, s.status.description,
                              {k: value(k, v) for k, v in sorted((s.attributes or {}).items()) if (s.name, k) not in RACED},
                              [[e.name, sorted(e.attributes or {})] for e in s.events],
                              [[names.get(link.context.span_id, "elsewhere"), dict(link.attributes or {})]
                               for link in s.links]], default=str)
                  for s in spans if s.name.startswith("dcp."))  # fmt: skip


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def parent_announced() -> Path:
    """This process's parent announced in the spool as a survivor's process is (an agent's: it sends nothing here)."""
    ppid = os.getppid()
    spool = Path(os.environ[semconv.ENV_SPOOL_DIR])
    announced = spool / layout.survivor_name(ppid)
    announced.touch()
    return announced


def instrumented(mode: str, monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    monkeypatch.setenv(semconv.ENV_RUN_ID, JOB)
    provider, exporter = in_memory()
    _selftelemetry.reset()
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), span_export=mode)
    return exporter


def own_resource() -> Any:
    """The resource of the process's own provider."""
    return DCPInstrumentor().recorder.provider().resource


def saved(tmp_path: Path, name: str) -> None:
    """One save, its spans built (into the record, in node mode)."""
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / name))
    assert dcp_otel.flush(30)


def steps_of(spans: Any, name: str | None = "dcp.save") -> Counter[str]:
    """How many spans (``name``'s, or all with ``None``) each checkpoint (``step-N``) has among ``spans``."""
    return Counter(s.attributes[semconv.ATTR_CHECKPOINT_ID].rsplit("/", 1)[-1] for s in spans
                   if name is None or s.name == name)  # fmt: skip


def own_record() -> Path:
    spool = Path(os.environ[semconv.ENV_SPOOL_DIR])
    (name,) = [n for n in os.listdir(spool) if (p := layout.parse_name(n)) and not p.state]
    return spool / name


def test_the_node_sends_the_spans_the_process_would_have_sent_once_and_the_process_sends_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    exporter = instrumented("process", monkeypatch)
    try:
        checkpoints(tmp_path / "process")
    finally:
        dcp_otel.uninstrument()
    itself = shape(list(exporter.get_finished_spans()), tmp_path / "process")
    assert len(itself) >= 12, itself

    exporter = instrumented("node", monkeypatch)
    try:
        checkpoints(tmp_path / "node")
        assert not [s for s in exporter.get_finished_spans() if s.name.startswith("dcp.")]  # not one of its own
        node_provider, node_exporter = in_memory()
        node = NodeExport(Delivery(lambda: node_provider, 10))
        record = own_record()
        me = (os.getppid(), None)  # (not this process's parent: the record is the node's by its job)
        assert node.send(record.name, str(record), me, "another-job") == 0  # another job's: not ours
        # Of this job, but its parent runs a survivor (another agent of the job on this host): that one's to send.
        assert node.send(record.name, str(record), me, JOB, parents={os.getppid()}) == 0
        sent = NodeExport(Delivery(lambda: node_provider, 10)).send(record.name, str(record), me, JOB)
        assert sent == len(node_exporter.get_finished_spans()) > 0
        assert NodeExport(Delivery(lambda: node_provider, 10)).send(record.name, str(record), me, JOB) == 0  # once
        by_node = shape(list(node_exporter.get_finished_spans()), tmp_path / "node")
        assert by_node == itself
        # The process's resource (its pid named), not the node's.
        resources = {json.dumps(dict(s.resource.attributes), sort_keys=True) for s in node_exporter.get_finished_spans()}
        own = {**own_resource().attributes, "process.pid": os.getpid()}
        assert resources == {json.dumps(own, sort_keys=True)}
        # The process drops what the node sent as it keeps the next checkpoint's spans.
        saved(tmp_path / "node", "step-4")
        lines = (record / layout.SPANS_FILE).read_text().splitlines()
        assert [json.loads(line)[0] for line in lines] == [read_record(str(record)).exported_through + 1]
    finally:
        dcp_otel.uninstrument()


def test_an_agents_survivor_sends_its_jobs_live_records_unless_another_survivor_is_their_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Two agents of one job on a host (``--nnodes 2`` on one machine): each sends its own workers' spans only."""
    instrumented("node", monkeypatch)
    try:
        saved(tmp_path, "step-1")
        other = parent_announced()  # (this process's parent: the other agent)
        provider, exporter = in_memory()
        agent = Survivor(os.environ[semconv.ENV_SPOOL_DIR], Delivery(lambda: provider, 10), JOB, live=True)
        agent.scan()
        assert agent.node is not None and agent.node.sent == 0 and not exporter.get_finished_spans()
        other.unlink()  # its parent runs no survivor: the job's agent sends it
        agent.scan()
        assert agent.node.sent > 0 and len(exporter.get_finished_spans()) == agent.node.sent
    finally:
        dcp_otel.uninstrument()


def test_what_the_node_has_not_sent_at_the_end_stays_in_the_record_for_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    instrumented("node", monkeypatch)
    saved(tmp_path, "step-1")
    record = own_record()
    dcp_otel.uninstrument()
    left = read_record(str(record))
    assert left.exited and {s.name for s in left.unexported()} >= {"dcp.save", "dcp.checkpoint", "dcp.write_data"}


def test_a_process_no_agent_of_ours_started_says_at_its_first_checkpoint_that_its_spans_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    instrumented("node", monkeypatch)
    try:
        saved(tmp_path, "step-1")
        assert dcp_otel.diagnostics().get("spool_spans_unsent") == 1  # (this test's parent runs no survivor)
        saved(tmp_path, "step-2")
        assert dcp_otel.diagnostics().get("spool_spans_unsent") == 1  # said once
    finally:
        dcp_otel.uninstrument()


def test_a_process_whose_agent_sends_nothing_for_30_s_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parent_announced()  # (an agent that sends nothing)
    instrumented("node", monkeypatch)
    try:
        saved(tmp_path, "step-1")
        spool_of = DCPInstrumentor().spool
        assert spool_of is not None and spool_of.keep.node
        assert "spool_spans_unsent" not in dcp_otel.diagnostics()
        spool_of.keep._waiting_since -= 31  # as if 31 s had passed with nothing sent
        saved(tmp_path, "step-2")
        assert dcp_otel.diagnostics().get("spool_spans_unsent") == 1
    finally:
        dcp_otel.uninstrument()


def test_a_process_whose_record_cannot_be_made_exports_its_spans_itself(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    exporter = instrumented("node", monkeypatch)
    spool = Path(os.environ[semconv.ENV_SPOOL_DIR])
    try:
        shutil.rmtree(spool)
        spool.write_text("")  # the spool, unusable from now on: the record is made at the first checkpoint
        saved(tmp_path, "step-1")
        assert {"dcp.save", "dcp.checkpoint", "dcp.write_data"} <= {s.name for s in exporter.get_finished_spans()}
        assert dcp_otel.diagnostics().get("spool_error", 0) >= 1
    finally:
        dcp_otel.uninstrument()
        spool.unlink()
        spool.mkdir()


def test_a_bad_span_export_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="span_export must be one of"):
        dcp_otel.instrument(span_export="agent")


# --- real torchrun --------------------------------------------------------------------------------------------------
def torchrun(out: Path, command: list[str], env: dict[str, str]) -> tuple[int, dict[int, str]]:
    out.mkdir(parents=True)
    done = subprocess.run([*command, str(WORKERS / "node_rank.py"), str(out)], capture_output=True, text=True,
                          timeout=180, cwd=out, env=rank_env(**{semconv.ENV_SPOOL_DIR: str(out / "spool"), **env}))  # fmt: skip
    said = {int(p.stem.split("-")[1]): p.read_text() for p in out.glob("rank-*.txt")}
    assert done.returncode == 0 or not env, done.stderr[-3000:]
    return done.returncode, said


def otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "train", "DCP_OTEL_METRICS": "none"}  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job plain, under ``opentelemetry-instrument``, and so with ``DCP_OTEL_SPAN_EXPORT=node``."""
    tmp = tmp_path_factory.mktemp("node-jobs")
    found: dict[str, Any] = {"plain": torchrun(tmp / "plain", TORCHRUN, {}), "tmp": tmp}
    for mode in ("process", "node"):
        with OtlpReceiver() as receiver:
            code, said = torchrun(tmp / mode, [str(BIN / "opentelemetry-instrument"), *TORCHRUN],
                                  {**otel_env(receiver), semconv.ENV_SPAN_EXPORT: mode})  # fmt: skip
            found[mode] = (code, said, list(receiver.spans))
    return found


def test_under_torchrun_the_agent_sends_every_rank_s_spans_and_the_ranks_send_none(jobs: dict[str, Any]) -> None:
    received = {mode: Counter((s.name, s.attributes.get(semconv.ATTR_RANK))
                              for s in jobs[mode][2] if s.name.startswith("dcp.") and s.name != semconv.SPAN_PROCESS)
                for mode in ("process", "node")}  # fmt: skip
    assert received["node"] == received["process"], received
    assert {rank for _, rank in received["node"]} == {0, 1}
    assert ("dcp.async_upload", 0) in received["node"] and ("dcp.load", 1) in received["node"]
    # With each rank's own resource: its pid (the agent's is another), the service it named.
    node = [s for s in jobs["node"][2] if s.name.startswith("dcp.") and s.name != semconv.SPAN_PROCESS]
    pids = {rank: {s.resource.get("process.pid") for s in node if s.attributes.get(semconv.ATTR_RANK) == rank}
            for rank in (0, 1)}  # fmt: skip
    said = {rank: {int(re.search(r"pid (\d+)", jobs["node"][1][rank]).group(1))} for rank in (0, 1)}  # type: ignore[union-attr]
    assert pids == said and {s.resource.get("service.name") for s in node} == {"train"}
    own = {mode: [re.search(r"own dcp spans (\d+)", jobs[mode][1][rank]).group(1) for rank in (0, 1)]  # type: ignore[union-attr]
           for mode in ("process", "node")}  # fmt: skip
    assert own["node"] == ["0", "0"] and all(int(n) > 0 for n in own["process"]), own
    # Each span once.
    ids = [(s.trace_id, s.span_id) for s in jobs["node"][2] if s.name.startswith("dcp.")]
    assert len(ids) == len(set(ids))


def test_under_torchrun_the_job_does_what_it_does_plain(jobs: dict[str, Any]) -> None:
    plain_code, plain_said = jobs["plain"]
    for mode in ("process", "node"):
        code, said, _ = jobs[mode]
        assert code == plain_code == 0
        assert {rank: text.splitlines()[0] for rank, text in said.items()} == \
            {rank: text.splitlines()[0] for rank, text in plain_said.items()}  # fmt: skip


def test_under_torchrun_the_agent_takes_its_announcement_out_of_the_spool_as_it_exits(jobs: dict[str, Any]) -> None:
    """The spool says which survivors run; once the agent has gone, none of its saying so is left behind."""
    for mode in ("process", "node"):
        left = sorted(p.name for p in (jobs["tmp"] / mode / "spool").iterdir())
        assert not [name for name in left if name.endswith(f".{layout.SURVIVOR}")], (mode, left)


def test_a_look_sends_every_live_records_lines_in_one_delivery_and_moves_each_records_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A node's ranks in one export request a look, not one each; and an exporter stuck on one rank's lines no
    longer has the others' refused (not handed over on top of it) and left for a retry 30 s later."""
    instrumented("node", monkeypatch)
    ppid = os.getppid()
    other = Path(os.environ[semconv.ENV_SPOOL_DIR]) / layout.directory_name(layout.host_name(), ppid,
                                                                            layout.start_ticks(ppid) or 0)  # fmt: skip
    try:
        saved(tmp_path, "step-1")
        record = own_record()
        shutil.copytree(record, other)  # a second live rank of the job (this process's parent), its lines as ours
        provider, exporter = in_memory()
        delivery, deliveries = Delivery(lambda: provider, 10), []
        survivor = Survivor(str(record.parent), lambda spans: deliveries.append(len(spans)) or delivery(spans), JOB,
                            live=True)  # fmt: skip
        survivor.scan()
        sent = Counter((s.context.trace_id, s.context.span_id) for s in exporter.get_finished_spans())
        assert len(deliveries) == 1 and deliveries[0] == sum(sent.values()) and set(sent.values()) == {2}
        assert read_record(str(record)).exported_through == read_record(str(other)).exported_through > 0
        survivor.scan()
        assert len(deliveries) == 1  # nothing new: no delivery
    finally:
        dcp_otel.uninstrument()
        shutil.rmtree(other, ignore_errors=True)


def test_a_look_cut_short_after_reading_a_records_lines_sends_them_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A look reads each live record's new lines, then sends them all at its end. An exception between (found by a
    review) left what was read unsent and its mark unmoved, so the next look read the lines again and sent every span
    twice; what was read now goes out as the look ends, however it ends."""
    instrumented("node", monkeypatch)
    try:
        saved(tmp_path, "step-1")
        record = own_record()
        provider, exporter = in_memory()
        survivor = Survivor(str(record.parent), Delivery(lambda: provider, 10), JOB, live=True)
        assert survivor.node is not None
        take, raised = survivor.node.take, []

        def take_then_fail(*args: Any, **kwargs: Any) -> None:
            take(*args, **kwargs)
            if not raised:
                raised.append(True)
                raise OSError("a record that cannot be read, after this one")

        monkeypatch.setattr(survivor.node, "take", take_then_fail)
        with pytest.raises(OSError):
            survivor.scan()
        survivor.scan()
        sent = Counter((s.context.trace_id, s.context.span_id) for s in exporter.get_finished_spans())
        assert sent and set(sent.values()) == {1}
    finally:
        dcp_otel.uninstrument()


def test_spans_an_earlier_instrumentation_left_unsent_are_sent_with_the_next_ones_each_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``uninstrument()`` leaves the lines the node has not sent in the record; instrumented again, the process makes
    its record again in the same directory: the lines are kept, numbered on, and the node sends them all, once."""
    instrumented("node", monkeypatch)
    saved(tmp_path, "step-1")
    record = own_record()
    dcp_otel.uninstrument()
    instrumented("node", monkeypatch)
    try:
        saved(tmp_path, "step-2")
        assert own_record() == record
        provider, exporter = in_memory()
        node = NodeExport(Delivery(lambda: provider, 10))
        assert node.send(record.name, str(record), (0, 0), JOB) > 0
        assert steps_of(exporter.get_finished_spans()) == {"step-1": 1, "step-2": 1}
        # The process drops them all at its next line, which is numbered after them.
        saved(tmp_path, "step-3")
        assert [json.loads(line)[0] for line in (record / layout.SPANS_FILE).read_text().splitlines()] == [3]
    finally:
        dcp_otel.uninstrument()


def test_spans_left_for_the_node_are_exported_by_the_process_instrumented_again_in_its_own_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A process that switches from ``span_export="node"`` to its own export before the node sent its last lines:
    those lines were given to no exporter, so the process's provider is given them (with its resource), each once,
    and the record counts them sent only then. (Before, the process's next confirmed flush counted them with its own
    lines, and nobody ever sent them.)"""
    instrumented("node", monkeypatch)
    saved(tmp_path, "step-1")
    record = own_record()
    dcp_otel.uninstrument()
    left = [json.loads(line) for line in (record / layout.SPANS_FILE).read_text().splitlines()]
    assert left and all(line[1][-1] == layout.NODE_LINE for line in left)
    exporter = instrumented("process", monkeypatch)
    try:
        saved(tmp_path, "step-2")
        assert own_record() == record
        spans = exporter.get_finished_spans()
        assert steps_of(spans) == {"step-1": 1, "step-2": 1}
        assert {s.resource.attributes.get("service.name") for s in spans} == {own_resource().attributes.get("service.name")}
        # The process's own lines say nothing of the node, and every line is confirmed: none is left for anybody.
        assert not (record / layout.SPANS_FILE).read_text()
        assert not read_record(str(record)).unexported()
    finally:
        dcp_otel.uninstrument()


def test_spans_left_for_the_node_stay_in_the_record_where_the_process_instrumented_again_takes_none_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Instrumented again in its own mode with a provider that records nothing (so it keeps no line, and adopts none),
    the process leaves the node's lines in its record at the close, marked exited, for a survivor to send."""
    from opentelemetry.trace import NoOpTracerProvider

    instrumented("node", monkeypatch)
    saved(tmp_path, "step-1")
    record = own_record()
    dcp_otel.uninstrument()
    _selftelemetry.reset()
    dcp_otel.instrument(tracer_provider=NoOpTracerProvider(), registry=CollectorRegistry())
    try:
        saved(tmp_path, "step-2")
    finally:
        dcp_otel.uninstrument()
    kept = read_record(str(record))
    assert kept.exited and set(steps_of(kept.unexported())) == {"step-1"}


def test_a_process_instrumented_again_sends_a_bounded_share_of_the_spans_left_for_the_node_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Past what one hand-over takes (``MAX_LEFT_SPANS``, half a batch processor's queue), the newest are sent and the
    rest counted, never dropped unsaid by the processor's queue."""
    from dcp_otel.spool import spans as spool_spans

    monkeypatch.setattr(spool_spans, "MAX_LEFT_SPANS", 5)
    instrumented("node", monkeypatch)
    saved(tmp_path, "step-1")
    saved(tmp_path, "step-2")
    dcp_otel.uninstrument()
    exporter = instrumented("process", monkeypatch)
    try:
        saved(tmp_path, "step-3")
        ids = steps_of(exporter.get_finished_spans(), None)
        assert sum(n for step, n in ids.items() if step != "step-3") == 5 and ids.get("step-2", 0) > 0, ids
        assert dcp_otel.diagnostics().get("spool_spans_full") == 1
    finally:
        dcp_otel.uninstrument()


def test_spans_left_for_the_node_are_exported_though_the_record_is_too_full_to_keep_the_next_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The first line after a mode switch that does not fit (``MAX_BYTES``) is not kept, and said; the lines left for
    the node are handed over all the same (the flush that comes would count them sent)."""
    from dcp_otel.spool import spans as spool_spans

    instrumented("node", monkeypatch)
    saved(tmp_path, "step-1")
    record = own_record()
    dcp_otel.uninstrument()
    monkeypatch.setattr(spool_spans, "MAX_BYTES", (record / layout.SPANS_FILE).stat().st_size + 10)
    exporter = instrumented("process", monkeypatch)
    try:
        saved(tmp_path, "step-2")
        assert steps_of(exporter.get_finished_spans()) == {"step-1": 1, "step-2": 1} and dcp_otel.diagnostics().get("spool_spans_full") == 1
    finally:
        dcp_otel.uninstrument()
