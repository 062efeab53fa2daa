"""Whoever reads telemetry first lets the builder finish what is queued.

Spans and metrics are built on a background thread, a few milliseconds after
an operation ends. Code that reads them right away must not miss them:

* :class:`DrainOnFlush`, a span processor put first on the SDK provider the
  spans go to, so that ``provider.force_flush()`` and ``provider.shutdown()``
  (the SDK's exit hook too) build everything queued before the exporters
  flush or stop;
* :class:`DrainOnCollect`, a collector registered in the metrics registry
  before our metrics, so that a scrape or ``registry.get_sample_value(...)``
  sees every finished operation's observations (and the counts of what
  emitting its spans dropped).

Both wait a bounded time and never raise.

Usage (what the instrumentor does)::

    remove = DrainOnFlush.attach(provider, builder, timeout_s=10)
    registry.register(DrainOnCollect(builder))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.builder import SpanBuilder


class DrainOnFlush(SpanProcessor):
    """Builds what is queued when the provider flushes or shuts down; does nothing per span."""

    def __init__(self, builder: SpanBuilder, timeout_s: float) -> None:
        self._builder = builder
        self._timeout_s = timeout_s

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._builder.drain(min(self._timeout_s, timeout_millis / 1000))

    def shutdown(self) -> None:
        self._builder.drain(self._timeout_s)

    @classmethod
    def attach(cls, provider: object, builder: SpanBuilder, timeout_s: float) -> Callable[[], None] | None:
        """Put a :class:`DrainOnFlush` first among ``provider``'s processors; returns its remover.

        ``None`` for a provider that is not the SDK's (nothing to hook: its
        users call ``dcp_otel.flush()``, which drains first anyway).
        """
        multi: Any = getattr(provider, "_active_span_processor", None)
        lock = getattr(multi, "_lock", None)
        if multi is None or lock is None or not isinstance(getattr(multi, "_span_processors", None), tuple):
            return None
        processor = cls(builder, timeout_s)
        try:
            with lock:  # first, so the exporters' own flush comes after the spans exist
                multi._span_processors = (processor, *multi._span_processors)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("builder_error", "dcp_otel could not hook the tracer provider's flush", exc_info=True)
            return None

        def remove() -> None:
            with lock:
                multi._span_processors = tuple(p for p in multi._span_processors if p is not processor)

        return remove


class ProviderHooks:
    """The :class:`DrainOnFlush` hooks of one recorder, one per provider, undone together."""

    def __init__(self, builder: SpanBuilder, timeout_s: float) -> None:
        self._builder = builder
        self._timeout_s = timeout_s
        self._removers: dict[int, Callable[[], None] | None] = {}  # id(provider) -> undo its hook

    def add(self, provider: object) -> None:
        if id(provider) not in self._removers:
            self._removers[id(provider)] = DrainOnFlush.attach(provider, self._builder, self._timeout_s)

    def remove_all(self) -> None:
        for remove in self._removers.values():
            if remove is not None:
                remove()
        self._removers.clear()


class DrainOnCollect:
    """A collector with no metrics of its own: collecting it waits for queued metrics."""

    def __init__(self) -> None:
        self.builder: SpanBuilder | None = None

    def describe(self) -> Iterable[Any]:
        return ()

    def collect(self) -> Iterable[Any]:
        builder = self.builder
        if builder is not None:
            # Spans too: what emitting them counts (a span queue that drops) is a metric as well. Not hurried where
            # waiting loses nothing: a scrape that came while an async save waits for the training step its upload
            # ended in would cut that measure short, its span a step short of the histogram.
            builder.drain_for_reader()
        return ()
