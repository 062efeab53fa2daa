"""What dcp-otel exposes: endpoints only where configured, no credentials, no unbounded labels."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.logger as dcp_log
from prometheus_client import CollectorRegistry, generate_latest

import dcp_otel
from dcp_otel import _selftelemetry, semconv

SECRETS = ("hunter2", "AKIASECRET", "SIGSECRET", "sastoken")


def other_local_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent for a UDP connect
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_a_metrics_endpoint_binds_only_the_configured_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(semconv.ENV_METRICS_ADDR, "127.0.0.1")
    endpoint = dcp_otel.start_metrics_server(0, registry=CollectorRegistry())
    assert endpoint is not None
    try:
        assert endpoint._server.server_address[0] == "127.0.0.1"  # type: ignore[attr-defined]
        socket.create_connection(("127.0.0.1", endpoint.port), timeout=5).close()
        other = other_local_address()
        if other is not None:  # reachable from this host only: the machine's other address is refused
            with pytest.raises(OSError):
                socket.create_connection((other, endpoint.port), timeout=5).close()
    finally:
        endpoint.close()


def test_credentials_in_checkpoint_ids_reach_no_span_metric_or_log(traced, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    ids = [
        "s3://AKIASECRET:hunter2@bucket/ckpt",
        "https://bucket.s3.amazonaws.com/ckpt?X-Amz-Credential=AKIASECRET&X-Amz-Signature=SIGSECRET",
        "gs://bucket/ckpt?X-Goog-Signature=SIGSECRET",
        "https://acct.blob.core.windows.net/c/ckpt?sv=2024&sig=sastoken",
    ]
    for i, checkpoint_id in enumerate(ids):
        class CloudWriter(dcp.FileSystemWriter):
            @property
            def checkpoint_id(self) -> str:  # what a cloud storage writer reports
                return checkpoint_id  # noqa: B023 - read during this iteration's save

        with caplog.at_level(logging.DEBUG, logger="dcp_otel"):
            dcp.save({"w": torch.ones(4)}, storage_writer=CloudWriter(str(tmp_path / f"c{i}")))
            # Records dcp-otel cannot use are warned about: the warning must not quote the id.
            for bad in ({"event": "start", "func_name": "save", "time": 1, "checkpoint_id": checkpoint_id},
                        {"event": "end", "uuid": "x", "func_name": "save", "time": "t", "checkpoint_id": checkpoint_id},
                        {"event": "end", "uuid": "y", "func_name": "save", "time": 5, "checkpoint_id": checkpoint_id}):
                _selftelemetry.reset()  # every warning logged, not rate-limited away
                dcp_log._dcp_logger.debug(bad)
    spans = traced.spans()
    assert len({s.attributes[semconv.ATTR_CHECKPOINT_ID] for s in spans}) == len(ids)  # redacted, not dropped
    # Our logs; torch's own DCP logger records the raw id, which is torch's business.
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("dcp_otel"))
    assert "dropped a DCP" in ours  # the warnings were logged, so they were checked
    for where, text in (("spans", repr(spans)), ("metrics", generate_latest(traced.registry).decode()),
                        ("logs", ours)):  # fmt: skip
        assert not [secret for secret in SECRETS if secret in text], (where, text[:3000])


def test_no_metric_label_takes_free_text(traced) -> None:  # type: ignore[no-untyped-def]
    t0 = 1_700_000_000_000_000_000
    record = {"event": "start", "uuid": "op", "func_name": "save", "time": t0, "checkpoint_id": "/c"}
    dcp_log._dcp_logger.debug(record)
    for i in range(500):  # 500 steps with names no DCP function has
        name = f"User Step {i} /with/path?and=query"
        dcp_log._dcp_logger.debug({**record, "uuid": f"s{i}", "func_name": name, "time": t0 + i})
        dcp_log._dcp_logger.debug({**record, "event": "end", "uuid": f"s{i}", "func_name": name, "time": t0 + i + 1})
    dcp_log._dcp_logger.debug({**record, "event": "end", "time": t0 + 10_000})
    values = {
        value
        for metric in traced.registry.collect()
        for sample in metric.samples
        for key, value in sample.labels.items()
        if key in (semconv.LABEL_OPERATION, semconv.LABEL_STEP)
    }
    # "-" is the step of an operation between steps, in the in-progress and stall series (the watchdog may
    # report this one, whose start is in 2023): a fixed value, not free text.
    assert values <= {"save", "other", semconv.STEP_NONE}
