"""Where a survivor sends a dead process's spans: its own tracer provider, else the OTLP endpoint of ``OTEL_*``.

Spans rebuilt from a record carry the dead process's resource (its host, rank,
service), so they are handed to the span processors of a provider directly
(``on_end``: batch and simple processors export whatever ``ReadableSpan`` they
get), never started again through a tracer, which would give them the
survivor's resource. A process with an SDK provider (``opentelemetry-instrument``,
or one set in code: the next generation of a restarted job) sends them through
it, with every exporter the user configured. A process without one
(``dcp-otel-run`` on its own) builds the exporters the ``OTEL_*`` variables name,
by the SDK's own rules, as the async save process does. torchelastic's agent
(``direct``) sends to those exporters even where it has a provider
(``opentelemetry-instrument``'s, made of the same): the SDK's batch processor
says nothing of what its exporter answered, and the agent tries a failed export
again until its deadline.

Usage::

    send = Delivery(lambda: trace.get_tracer_provider(), timeout_s=10)
    send(spans)            # True: every exporter took them in time (through a provider: its flush ended in time)
    agent = Delivery(lambda: trace.get_tracer_provider(), timeout_s=10, direct=True)
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Final

from opentelemetry import context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.flushing import BoundedFlush

_OTLP_ENDPOINT_VARS: Final = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
#: How long a direct delivery waits before it tries an export that failed again (within its deadline) ...
RETRY_PAUSE_S: Final = 0.5
#: ... unless its exporter answered a failure faster than this: refused, not tried again (OTLP's exporters retry what
#: may pass, the first time after 0.8 to 1.2 s).
REFUSED_BELOW_S: Final = 0.5
#: The most spans a delivery remembers as sent after its deadline (beyond, it forgets the oldest).
_SENT_LATE_MAX: Final = 65536
#: The spans one export request of exporters of the environment carries (a batch processor's default batch: a dead
#: process's record may hold thousands, and a collector limits a request's size).
EXPORT_BATCH: Final = 512


def hand_over() -> int:
    """The most spans handed to a provider's span processors before a flush: half a batch processor's queue
    (``OTEL_BSP_MAX_QUEUE_SIZE``, 2,048 by default), which drops what overflows it, unsaid. A processor made in code
    with a smaller queue is not seen here."""
    try:
        queue = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "") or 2048)
    except ValueError:
        queue = 2048  # (the SDK says it, and uses its default)
    return max(1, queue // 2)


def chunks(spans: Sequence[ReadableSpan], size: int) -> list[Sequence[ReadableSpan]]:
    """``spans`` in slices of at most ``size``, in order."""
    return [spans[i : i + size] for i in range(0, len(spans), size)]


def exporter_names() -> list[str]:
    """The span exporters the ``OTEL_*`` variables name (the SDK's rules); OTLP where only an endpoint is set."""
    named = os.environ.get(semconv.ENV_OTEL_TRACES_EXPORTER)
    endpoint = any(os.environ.get(v) for v in _OTLP_ENDPOINT_VARS)
    if (named is None and not endpoint) or (named is not None and named.strip().lower() in ("", "none")):
        return []  # (without loading the SDK's configuration module: a launcher's exit waits on this)
    from opentelemetry.sdk._configuration import _get_exporter_entry_point, _get_exporter_names

    names = _get_exporter_names("traces")
    if not names and named is None and endpoint:
        names = [_default_otlp_exporter(_get_exporter_entry_point)]
    return names


def _default_otlp_exporter(entry_point_for: Callable[[str, Any], str]) -> str:
    """OTLP with no exporter named: the protocol asked for, else the OTLP exporter installed.

    Only an OTLP endpoint is set. The SDK would pick gRPC, the spec's default is
    HTTP; what the process can actually use is whichever of them is installed.
    """
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"):
        return entry_point_for("otlp", "traces")
    installed = {ep.name for ep in entry_points(group="opentelemetry_traces_exporter")}
    return "otlp_proto_http" if "otlp_proto_http" in installed or "otlp_proto_grpc" not in installed else "otlp_proto_grpc"


def environment_exporters(names: list[str] | None = None) -> list[SpanExporter]:
    """New instances of the exporters ``names`` (default: :func:`exporter_names`); raises if one cannot load."""
    names = exporter_names() if names is None else names
    if not names:
        return []  # (without loading the SDK's configuration, whose import resets which warnings were shown)
    from opentelemetry.sdk._configuration import _import_exporters

    exporters, _, _ = _import_exporters(names, [], [])
    return [exporter_class() for exporter_class in exporters.values()]


def span_processor(provider: object) -> Any:
    """The SDK provider's span processors (one multi-processor), if it has any; else ``None``."""
    processor = getattr(provider, "_active_span_processor", None)
    if processor is None or not getattr(processor, "_span_processors", ()):
        return None
    return processor


class Delivery:
    """Sends rebuilt spans (see the module); bounded by ``timeout_s``, never raises."""

    def __init__(self, provider: Callable[[], object], timeout_s: float, direct: bool = False,
                 exporters: list[SpanExporter] | None = None) -> None:  # fmt: skip
        """``direct``: to ``exporters`` (default: those the ``OTEL_*`` variables name, made when first needed) where
        there are any, before the provider's processors: each export's answer is known, and one that failed is tried
        again until the deadline. The SDK's batch processor says its flush succeeded whatever its exporter answered,
        so a collector down for longer than one exporter's retries lost the spans, counted sent (found by a review:
        down for 8 s, none of two dead ranks' arrived). For torchelastic's agent, whose provider's exporters are the
        environment's; a rank's provider may have exporters of its own, set in code, and keeps them."""
        self._provider = provider
        self._timeout_s = timeout_s or 10.0
        self._direct = direct
        self._exporters = exporters  # (None: from the environment, made when first needed)
        self._flush: BoundedFlush | None = None  # the last flush: while it is stuck, nothing more is handed over
        self._exporting: threading.Thread | None = None  # the same, for exporters of the environment
        self._late: tuple[set[tuple[int, int]], list[bool]] | None = None  # an export its deadline left under way
        self._sent_late: dict[tuple[int, int], None] = {}  # the spans such exports sent, oldest first: not sent again
        self._deadline = 0.0  # the last delivery's

    def can_deliver(self) -> bool:
        """Whether there is anywhere to send spans (a provider with processors, or exporters the environment names);
        nothing is loaded to say it."""
        if span_processor(self._provider()) is not None:
            return True
        return bool(exporter_names()) if self._exporters is None else bool(self._exporters)

    def _export(self, exporters: list[SpanExporter], spans: Sequence[ReadableSpan], deadline: float) -> bool:
        """``spans`` to ``exporters`` on a daemon thread (an exporter may hang), waited for until ``deadline``."""
        if self._exporting is not None and self._exporting.is_alive():
            # The last export, still retrying, is waited for within this one's time, not refused at once: at the
            # job's end the ranks' last spans were refused so, and left behind by the agent's exit (a collector down
            # 13 s). One stuck for good: these are not piled on it.
            self._exporting.join(max(0.0, deadline - time.monotonic()))
            if self._exporting.is_alive():
                return False
        late, self._late = self._late, None
        if late is not None and late[1] == [True] * len(exporters):
            # The last delivery's export got through after its deadline, which said it had not (its exporter retried
            # on its own clock): those spans, handed over again (a record's lines, a death tried again), are not
            # sent twice (found by a review: a collector down 13 s, 19 spans sent twice).
            self._sent_late.update(dict.fromkeys(late[0]))
            for key in list(itertools.islice(self._sent_late, max(0, len(self._sent_late) - _SENT_LATE_MAX))):
                del self._sent_late[key]  # (the oldest first: a review found a reset dropping keys still needed)
        if self._sent_late:
            spans = [span for span in spans if _key(span) not in self._sent_late]
            if not spans:
                return True
        outcome: list[bool] = []
        retry_until = deadline if self._direct else 0.0
        self._exporting = threading.Thread(target=_export_all, args=(exporters, spans, outcome, retry_until),
                                           name="dcp-otel-survivor-export", daemon=True)  # fmt: skip
        self._exporting.start()
        self._exporting.join(max(0.0, deadline - time.monotonic()))
        if self._exporting.is_alive():
            self._late = ({_key(span) for span in spans}, outcome)
        return outcome == [True] * len(exporters)

    def settle(self) -> object | None:
        """At exit: the last flush of handed-over spans, waited for until its own deadline (an exporter that retries
        gets there within the timeout); the provider it went through if that flush is still under way (its exporter
        stuck), once, else ``None``: the exit shuts it down in the background, not waiting for it again. A flush that
        ended, even failing, leaves the SDK's exit hook in place: its exporter answers, and the application's own
        spans still go out through it."""
        if self._exporting is not None:  # (exporters of the environment: a daemon thread, no exit hook to pass)
            self._exporting.join(max(0.0, self._deadline - time.monotonic()))
        flush, self._flush = self._flush, None
        return flush.provider if flush is not None and flush.finish() is None else None

    def _environment(self) -> list[SpanExporter]:
        if self._exporters is None:
            try:
                self._exporters = environment_exporters()
            except Exception as exc:  # noqa: BLE001 - an exporter package that is not installed
                reraise_if_signalled(exc)
                report("survivor_no_exporter", "dcp_otel cannot load the span exporter(s) %s to report a dead "
                       "process", exporter_names(), exc_info=True)  # fmt: skip
                self._exporters = []
        return self._exporters

    def __call__(self, spans: Sequence[ReadableSpan]) -> bool:
        """Send ``spans``; ``True`` once every exporter took them within the timeout."""
        if not spans:
            return True
        deadline = self._deadline = time.monotonic() + self._timeout_s
        try:
            exporters = self._environment() if self._direct else []
            if exporters:
                return self._export(exporters, spans, deadline)
            provider = self._provider()
            processor = span_processor(provider)
            if processor is not None:
                if self._flush is not None and self._flush.running():
                    return False  # the exporter is stuck on the last ones: not these on top of them
                for chunk in chunks(spans, hand_over()):  # (a batch processor drops what overflows its queue, unsaid)
                    for span in chunk:
                        processor.on_end(span)
                    flush = self._flush = BoundedFlush(provider, "span", deadline)  # (an exit's settle may take it)
                    if flush.wait() is not True:
                        return False
                return True
            exporters = self._environment()
            return bool(exporters) and self._export(exporters, spans, deadline)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("survivor_error", "dcp_otel could not send a dead process's spans", exc_info=True)
            return False


def _key(span: ReadableSpan) -> tuple[int, int]:
    """A span's identity, as a backend counts it once."""
    return span.context.trace_id, span.context.span_id


def _export_all(exporters: list[SpanExporter], spans: Sequence[ReadableSpan], outcome: list[bool],
                retry_until: float = 0.0) -> None:  # fmt: skip
    """Each exporter's answer to ``spans`` into ``outcome``; an export that failed is tried again, a pause after
    it, until ``retry_until`` (a ``time.monotonic()``; 0: once)."""
    pause = threading.Event()  # (never set: a pause that the deadline, not a signal, ends)
    for exporter in exporters:
        ok = True
        for chunk in chunks(spans, EXPORT_BATCH):
            while True:
                began = time.monotonic()
                sent = _export_one(exporter, chunk)
                # An export that answered a failure at once was refused (a 400: OTLP's exporters retry what may pass,
                # for seconds), not tried again: a review saw 20 requests and 20 lines logged, and the agent's exit
                # 10 s late. One that raised met no collector (OTLP/HTTP before 1.45 raises a refused connection
                # after one quick retry): tried again (a third review).
                refused = sent is False and time.monotonic() - began < REFUSED_BELOW_S
                if sent or refused or time.monotonic() + RETRY_PAUSE_S >= retry_until:
                    break
                pause.wait(RETRY_PAUSE_S)
            if not sent:
                ok = False
                break
        outcome.append(ok)


def _export_one(exporter: SpanExporter, spans: Sequence[ReadableSpan]) -> bool | None:
    """The exporter's answer: ``True`` (taken), ``False`` (a failure it answered), ``None`` (it raised).

    With instrumentation suppressed, as the SDK's processors export: an instrumented HTTP client (``requests``,
    ``urllib3``, which ``opentelemetry-bootstrap`` installs) would make a span of the export request itself."""
    token = context.attach(context.set_value(context._SUPPRESS_INSTRUMENTATION_KEY, True))
    try:
        return exporter.export(spans) == SpanExportResult.SUCCESS
    except Exception as exc:  # noqa: BLE001
        reraise_if_signalled(exc)
        report("survivor_error", "a span exporter failed to send a dead process's spans", exc_info=True)
        return None
    finally:
        context.detach(token)

