"""Shared fixtures: a real SDK tracer provider with an in-memory exporter,
instrumented for the test and uninstrumented after it."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import _selftelemetry, semconv
from tests.browser import start
from tests.spans_io import SpanRecord, from_readable


@dataclass
class Traced:
    provider: TracerProvider
    exporter: InMemorySpanExporter
    registry: CollectorRegistry

    def spans(self) -> list[SpanRecord]:
        self.provider.force_flush()
        return from_readable(self.exporter.get_finished_spans())

    def recorder(self):  # type: ignore[no-untyped-def]
        return dcp_otel.DCPInstrumentor().recorder


# Module-scoped fixtures start jobs before any test's own spool is set: never into the machine's default spool.
os.environ[semconv.ENV_SPOOL_DIR] = tempfile.mkdtemp(prefix="dcp-otel-test-spool-")


@pytest.fixture(autouse=True)
def _own_spool(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test's processes keep their records in a spool of the test's own (the children inherit it): a record a
    test's killed process leaves is never taken by another test's survivor, nor by the machine's default spool."""
    monkeypatch.setenv(semconv.ENV_SPOOL_DIR, str(tmp_path_factory.mktemp("spool")))
    yield


@pytest.fixture(autouse=True)
def _quiet_dcp_warnings() -> Iterator[None]:
    # DCP warns on every single-process save ("torch.distributed is disabled ...").
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    yield tp, exporter
    tp.shutdown()


@pytest.fixture
def traced(provider: tuple[TracerProvider, InMemorySpanExporter]) -> Iterator[Traced]:
    """DCP instrumented into a fresh in-memory provider and metrics registry for one test."""
    tp, exporter = provider
    _selftelemetry.reset()
    registry = CollectorRegistry()  # a fresh registry per test
    dcp_otel.instrument(tracer_provider=tp, registry=registry)
    try:
        yield Traced(tp, exporter, registry)
    finally:
        dcp_otel.uninstrument()


@pytest.fixture
def dcp_records() -> Iterator[list[dict]]:
    """Copies of every record torch's DCP logger emits during the test."""
    from torch.distributed.checkpoint.logger import _dcp_logger

    records: list[dict] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(dict(record.msg))

    handler = Capture()
    _dcp_logger.addHandler(handler)
    yield records
    _dcp_logger.removeHandler(handler)


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    """Headless Chromium through the Debian chromium-driver (fails under $CI when missing)."""
    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        if os.environ.get("CI"):
            pytest.fail("chromedriver is missing in CI: scripts/setup.sh --browser installs it")
        pytest.skip("chromium-driver not installed (scripts/test.sh installs it)")
    driver = start(driver_path)
    yield driver
    driver.quit()
