"""A failing checkpoint: spans end with ERROR, the caller gets torch's own exception."""

from __future__ import annotations

import errno
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_otel
from dcp_otel import semconv
from dcp_otel.attach import patches as torch_hooks
from tests.spans_io import from_readable, named

INJECTED = OSError(errno.ENOSPC, "No space left on device")


class FullDiskWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        raise INJECTED


class BrokenModel(torch.nn.Module):
    error = ValueError("state_dict exploded")

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise self.error


def save_full_disk(path: Path) -> CheckpointException:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(4)}, storage_writer=FullDiskWriter(str(path)))
    return info.value


def test_a_step_torch_does_not_log_ends_with_error_and_its_real_exception(traced, tmp_path: Path) -> None:
    error = save_full_disk(tmp_path / "c")

    assert error.failures[0][0] is INJECTED  # torch's own exception, untouched
    spans = traced.spans()
    (write,) = named(spans, "dcp.write_data")
    assert write.status == "ERROR"
    assert write.status_description == "OSError: [Errno 28] No space left on device"
    (event,) = write.events
    assert event["name"] == "exception" and event["attributes"]["exception.type"] == "OSError"
    assert semconv.ATTR_END_INFERRED not in write.attributes  # closed when it failed, not later
    (save,) = named(spans, "dcp.save")
    assert save.status == "ERROR"
    assert save.status_description.startswith("CheckpointException: ranks [0] failed; rank 0: OSError")
    assert save.attributes[semconv.ATTR_FAILED_RANKS] == (0,)
    assert save.events[0]["attributes"]["exception.type"].endswith(".CheckpointException")
    (root,) = named(spans, semconv.SPAN_CHECKPOINT)
    assert root.status == "ERROR"
    assert not named(spans, "dcp.finish_checkpoint")  # torch never ran it


def test_a_failed_save_says_how_old_the_last_durable_save_is(traced, tmp_path: Path) -> None:
    """The work at risk: a failure's operation span carries the age of this process's last successful save."""
    save_full_disk(tmp_path / "before")  # nothing saved yet: no recovery point to say
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "ok"))
    dcp.load({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "ok"))  # a load is no recovery point
    save_full_disk(tmp_path / "after")
    assert dcp_otel.flush(timeout_s=30)
    spans = sorted(named(traced.spans(), "dcp.save"), key=lambda s: s.start_ns)
    first, ok, failed = spans
    assert semconv.ATTR_RECOVERY_POINT_AGE not in first.attributes and semconv.ATTR_RECOVERY_POINT_AGE not in ok.attributes
    age = failed.attributes[semconv.ATTR_RECOVERY_POINT_AGE]
    assert age == pytest.approx((failed.end_ns - ok.end_ns) / 1e9, abs=2e-3) and age > 0


def test_the_caller_gets_the_same_exception_with_or_without_instrumentation(provider, tmp_path: Path) -> None:
    plain = save_full_disk(tmp_path / "plain")
    dcp_otel.instrument(tracer_provider=provider[0])
    try:
        traced_error = save_full_disk(tmp_path / "traced")
        with pytest.raises(ValueError) as info:
            dcp.save({"model": BrokenModel()}, checkpoint_id=str(tmp_path / "broken"))
    finally:
        dcp_otel.uninstrument()

    assert info.value is BrokenModel.error
    assert type(traced_error) is type(plain)
    assert {r: (f[0], type(f[0])) for r, f in traced_error.failures.items()} == {
        r: (f[0], type(f[0])) for r, f in plain.failures.items()
    }


def test_a_failing_stateful_key_is_named_on_the_conversion_span(traced, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        dcp.save({"ok": torch.ones(1), "model": BrokenModel()}, checkpoint_id=str(tmp_path / "c"))

    spans = traced.spans()
    (convert,) = named(spans, "dcp._stateful_to_state_dict")
    assert convert.status == "ERROR"
    assert convert.attributes[semconv.ATTR_STATE_DICT_FAILED_KEY] == "model"
    assert convert.attributes[semconv.ATTR_STATE_DICT_KEYS] == 1  # "ok" converted before it
    (save,) = named(spans, "dcp.save")
    assert save.status == "ERROR" and save.status_description == "ValueError: state_dict exploded"


def test_without_the_exception_hook_failed_steps_still_end_when_their_parent_ends(
    provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a torch where ``_wrap_exception`` cannot be hooked: the step's
    # failure is only seen when ``save`` itself fails.
    without_hook = tuple(p for p in torch_hooks.PATCHES if p.name != "_wrap_exception")
    monkeypatch.setattr(torch_hooks, "PATCHES", without_hook)
    dcp_otel.instrument(tracer_provider=provider[0])
    try:
        save_full_disk(tmp_path / "c")
        recorder = dcp_otel.DCPInstrumentor().recorder
        assert (recorder.open_count(), recorder.stack_depth()) == (0, 0)
    finally:
        dcp_otel.uninstrument()

    (write,) = named(from_readable(provider[1].get_finished_spans()), "dcp.write_data")
    assert write.status == "ERROR"
    assert write.attributes[semconv.ATTR_END_INFERRED] is True
    assert write.status_description.startswith("did not return: CheckpointException: ranks [0] failed")


def test_no_span_is_left_open_after_failures(traced, tmp_path: Path) -> None:
    save_full_disk(tmp_path / "a")
    with pytest.raises(ValueError):
        dcp.save({"model": BrokenModel()}, checkpoint_id=str(tmp_path / "b"))
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"))  # and the next one is fine

    recorder = traced.recorder()
    assert (recorder.open_count(), recorder.stack_depth()) == (0, 0)
    spans = traced.spans()
    assert named(spans, "dcp.save")[-1].status == "UNSET"
    assert len(named(spans, semconv.SPAN_CHECKPOINT)) == 3


class SignedUrlWriter(dcp.FileSystemWriter):
    """A cloud writer whose error quotes the signed URL it failed on, as boto3 and gcs clients do."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        raise PermissionError(
            "403 PUT https://bucket.s3.amazonaws.com/ckpt/__0_0.distcp?X-Amz-Credential=AKIASECRET"
            "&X-Amz-Signature=SIGSECRET (via s3://AKIASECRET:se/cr+et@bucket/ckpt)"
        )


@pytest.mark.parametrize("kind", ["save", "async_save"])
def test_credentials_quoted_by_a_storage_error_reach_no_span(traced, tmp_path: Path, kind: str) -> None:
    writer = SignedUrlWriter(str(tmp_path / "c"))
    with pytest.raises(CheckpointException) as info:
        if kind == "save":
            dcp.save({"w": torch.ones(4)}, storage_writer=writer)
        else:
            dcp.async_save({"w": torch.ones(4)}, storage_writer=writer).result()
    assert "SIGSECRET" in str(info.value)  # the caller's exception is torch's, untouched
    traced.recorder().wait_for_uploads(30)
    spans = traced.spans()
    failed = [s for s in spans if s.status == "ERROR"]
    assert len(failed) >= 3  # write_data, the operation, the root (and the upload)
    text = repr(spans)
    assert "X-Amz-Signature=REDACTED" in text  # the error is still there, to read
    assert not [secret for secret in ("AKIASECRET", "SIGSECRET", "se/cr+et") if secret in text]


def huge_checkpoint_exception(ranks: int, own: int) -> CheckpointException:
    """torch's CheckpointException as the coordinator builds it when ``ranks`` ranks failed."""
    failures = {}
    for rank in range(ranks):
        try:
            raise OSError(errno.EIO, f"I/O error writing shard {rank} on node-{rank // 8}" + (" (OWN)" if rank == own else ""))
        except OSError as exc:
            failures[rank] = (exc, traceback.extract_tb(exc.__traceback__) + traceback.extract_stack())
    return CheckpointException("write", failures)


def test_a_thousand_failed_ranks_make_small_spans_that_keep_this_ranks_own_failure(traced, monkeypatch) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from torch.distributed.checkpoint.logger import _dcp_method_logger

    monkeypatch.setenv("RANK", "517")
    error = huge_checkpoint_exception(1024, own=517)
    assert len(str(error)) > 1_000_000  # what used to be recorded, twice per span

    @_dcp_method_logger(log_exceptions=True)
    def save() -> None:  # torch's own logging decorator, as on dcp.save
        raise error

    with pytest.raises(CheckpointException):
        save()
    (span,) = [s for s in traced.exporter.get_finished_spans() if s.name == "dcp.save"]
    size = len(encode_spans([span]).SerializeToString())
    assert size < 64 * 1024, size  # it was 1.4 MB
    (event,) = span.events
    assert "(OWN)" in event.attributes["exception.message"]  # this rank's own failure, not rank 0's
    assert "rank 517 (this rank)" in event.attributes["exception.message"]
    assert "ranks [0-1023] failed (1024)" in event.attributes["exception.message"]
    assert "(OWN)" in event.attributes["exception.stacktrace"] and "rank 517, where it failed" in event.attributes["exception.stacktrace"]
    assert list(span.attributes[semconv.ATTR_FAILED_RANKS]) == list(range(1024))  # every failed rank, as a list
    assert span.status.description.startswith("CheckpointException: ranks [0-1023] failed; rank 517: OSError")


def test_an_exception_raised_from_a_mass_failure_is_recorded_without_formatting_it_whole() -> None:
    from dcp_otel.tracing.failures import Failure

    error = huge_checkpoint_exception(1024, own=3)
    try:
        try:
            raise error
        except CheckpointException as inner:
            raise RuntimeError("the upload failed") from inner
    except RuntimeError as outer:
        failure = Failure(outer, None, rank=3)
    stacktrace = failure.event["exception.stacktrace"]
    assert len(stacktrace) < 8192  # not the 0.6 MB of the chained CheckpointException's text
    assert stacktrace.startswith("CheckpointException: ranks [0-1023] failed; rank 3: OSError")
    assert stacktrace.rstrip().endswith("RuntimeError: the upload failed")
