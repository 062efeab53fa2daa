"""Traces of DCP calls, in two halves that meet at a queue.

* :mod:`~dcp_otel.tracing.tracker` (with :mod:`~dcp_otel.tracing.operations`
  and :mod:`~dcp_otel.tracing.uploads`): the hot path, on the caller's thread.
  It pairs DCP's start and end events into :mod:`~dcp_otel.tracing.records`,
  chooses span ids, and makes light (non-recording) spans current. It must
  stay cheap: about 2 us a step.
* :mod:`~dcp_otel.tracing.builder` (with :mod:`~dcp_otel.tracing.detail`): on
  one background thread per process, turns each finished operation into SDK
  spans and metric observations, exporting as much detail as the policy says.

Usage::

    recorder = SpanRecorder(InstrumentOptions())   # what dcp_otel.instrument() creates
    recorder.drain(timeout_s=10)                  # everything finished is built
"""
