"""Spans to and from files in the standard OTLP JSON format.

Each line of a file is one ``ExportTraceServiceRequest`` in the OTLP/JSON
encoding (the OpenTelemetry protocol's JSON mapping: hex trace and span ids,
integer enums), which is also what the Collector's ``file`` exporter writes.
Reading also takes what trace backends' APIs answer for a trace: Tempo's
``/api/traces/<id>`` (``batches``, base64 ids) and ``/api/v2/traces/<id>``
(``trace``), and Jaeger's ``/api/v3/traces/<id>`` (``result``).
Encoding goes through the official protobuf messages
(``opentelemetry-proto``), so a file we write is one any OTLP tool reads.
Reading walks the JSON directly, checking the type of every field it uses
(protobuf's JSON parser took 42 s for a 500-checkpoint, 64-rank run; this
takes a few): anything that is not OTLP JSON is a :class:`SpanFileError`.

Usage::

    from dcp_otel.otlp_file import OTLPJsonFileExporter, read_spans

    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter("out/traces/rank-0.jsonl")))
    spans = read_spans(["out/traces/rank-0.jsonl"])   # -> list[FileSpan]; SpanFileError if malformed
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool.offline import read_spool, record_directories

_ID_FIELDS: Final = ("traceId", "spanId", "parentSpanId")
STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


class SpanFileError(ValueError):
    """A span file that is not OTLP JSON (or is cut short); the message says where and why."""


class OTLPJsonFileExporter(SpanExporter):
    """Appends each batch of spans to ``path`` as one OTLP/JSON line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        if _ends_mid_line(self.path):  # a writer killed mid-line before us: our first line starts on a line of its own
            self._file.write("\n")
            self._file.flush()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            line = json.dumps(to_otlp_json(encode_spans(spans)), separators=(",", ":"))
            with self._lock:
                self._file.write(line + "\n")
                self._file.flush()
            return SpanExportResult.SUCCESS
        except Exception as exc:  # noqa: BLE001 - an exporter reports, it does not raise into the SDK
            reraise_if_signalled(exc)
            report("span_file_error", "dcp_otel could not write spans to %s", self.path, exc_info=True)
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is flushed as it is written


def _ends_mid_line(path: Path) -> bool:
    try:
        with path.open("rb") as existing:
            size = existing.seek(0, os.SEEK_END)
            return size > 0 and existing.seek(size - 1) >= 0 and existing.read(1) != b"\n"
    except OSError:
        return False


def to_otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """The OTLP/JSON form of ``request``: protobuf's JSON mapping, with ids in hex as OTLP requires."""
    data: dict[str, Any] = json_format.MessageToDict(request, use_integers_for_enums=True)
    _convert_ids(data, lambda b64: base64.b64decode(b64).hex())
    return data


def from_otlp_json(data: object) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON request (raises ``ValueError`` or ``json_format.ParseError``)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    _convert_ids(data, lambda hexid: base64.b64encode(bytes.fromhex(hexid)).decode())
    request = ExportTraceServiceRequest()
    json_format.ParseDict(data, request)
    return request


def _convert_ids(node: object, convert: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_FIELDS and isinstance(value, str):
                node[key] = convert(value) if value else value
            else:
                _convert_ids(value, convert)
    elif isinstance(node, list):
        for item in node:
            _convert_ids(item, convert)


@dataclass
class FileSpan:
    """One span read back from a file: what the report needs, ids in hex."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    error: bool
    status_message: str
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    exception: str | None = None  # the message of its first ``exception`` event: the failure in full
    stacktrace: str | None = None  # that event's stack trace (of an interrupted call: where its thread was)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(value: AnyValue) -> Any:  # (an OTLP protobuf AnyValue)
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def spans_of(request: ExportTraceServiceRequest) -> Iterable[FileSpan]:
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield FileSpan(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    name=span.name,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    error=span.status.code == STATUS_ERROR,
                    status_message=span.status.message,
                    attributes={kv.key: _value(kv.value) for kv in span.attributes},
                    resource=resource,
                    **_exception_fields(next(
                        ({kv.key: _value(kv.value) for kv in event.attributes} for event in span.events
                         if event.name == "exception"), None)),  # fmt: skip
                )


def _exception_fields(attributes: dict[str, Any] | None) -> dict[str, str | None]:
    """A :class:`FileSpan`'s ``exception`` and ``stacktrace``, from its ``exception`` event's attributes."""
    stacktrace = attributes.get("exception.stacktrace") if attributes else None
    return {"exception": _exception_text(attributes), "stacktrace": stacktrace if isinstance(stacktrace, str) else None}


def _exception_text(attributes: dict[str, Any] | None) -> str | None:
    """``"OSError: [Errno 28] No space left on device"`` from an ``exception`` event's attributes."""
    if not attributes or attributes.get("exception.message") is None:
        return None
    message, kind = str(attributes["exception.message"]), attributes.get("exception.type")
    short = str(kind).rsplit(".", 1)[-1] if kind else ""
    return f"{short}: {message}" if short and not message.startswith(short) else message


def _json_value(value: object) -> Any:
    """An OTLP/JSON ``AnyValue``: ``{"stringValue": ...}``, ``{"intValue": "12"}``, arrays, key-value lists."""
    if not isinstance(value, dict):
        raise ValueError(f"an attribute value must be an object, got {type(value).__name__}")
    if not value:
        return None
    kind, inner = next(iter(value.items()))
    if kind == "stringValue" and isinstance(inner, str):
        return inner
    if kind == "intValue" and isinstance(inner, (int, str)) and not isinstance(inner, bool):
        return int(inner)
    if kind == "doubleValue" and isinstance(inner, (int, float, str)) and not isinstance(inner, bool):
        return float(inner)
    if kind == "boolValue" and isinstance(inner, bool):
        return inner
    if kind == "arrayValue" and isinstance(inner, dict):
        return [_json_value(v) for v in _list(inner, "values")]
    if kind == "kvlistValue" and isinstance(inner, dict):
        return _json_attributes(_list(inner, "values"))
    if kind == "bytesValue" and isinstance(inner, str):
        return base64.b64decode(inner)
    raise ValueError(f"not an OTLP attribute value: {kind}={inner!r:.60}")


def _list(node: dict[str, Any], key: str) -> list[Any]:
    found = node.get(key, [])
    if not isinstance(found, list):
        raise ValueError(f"{key} must be a list, got {type(found).__name__}")
    return found


def _json_attributes(items: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            raise ValueError(f"an attribute must be an object with a string key, got {item!r:.60}")
        out[item["key"]] = _json_value(item.get("value", {}))
    return out


def _json_id(span: dict[str, Any], key: str, size: int) -> str:
    """An id as lower-case hex: OTLP JSON writes hex; Tempo's API writes the bytes in base64."""
    value = span.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{key} must be {size * 2} hex digits or base64, got {value!r:.60}")
    if not value or len(value) == size * 2:
        bytes.fromhex(value)  # raises ValueError if not hex
        return value.lower()
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ValueError(f"{key} must be {size * 2} hex digits or base64 of {size} bytes, got {value!r:.60}")
    return raw.hex()


#: Where each trace API puts the OTLP ``resourceSpans`` (besides an OTLP request's own field):
#: Tempo's v1 trace by id (``batches``), Tempo's v2 (``trace``), Jaeger v2's ``/api/v3/traces`` (``result``).
_WRAPPERS: Final = {"trace": "Tempo v2", "result": "Jaeger /api/v3"}
_ALLOWED_BESIDE: Final = {"status", "message", "metrics"}  # what a trace API says about its answer


def _resource_spans(document: dict[str, Any]) -> list[Any]:
    if "batches" in document:  # Tempo's /api/traces/<id>
        key, inner = "batches", document
        extra = set(document) - {key} - _ALLOWED_BESIDE
    elif wrapper := next((key for key in _WRAPPERS if key in document), None):
        key, inner = "resourceSpans", document[wrapper]
        if not isinstance(inner, dict):
            raise ValueError(f"{wrapper} must be an object, got {type(inner).__name__}")
        extra = (set(document) - {wrapper} - _ALLOWED_BESIDE) | (set(inner) - {key})
    else:  # an OTLP request, as we and the Collector's file exporter write it
        key, inner = "resourceSpans", document
        extra = set(document) - {key}
    if extra:
        raise ValueError(f"not a trace request: unexpected field(s) {sorted(extra)}")
    return _list(inner, key)


def _json_time(span: dict[str, Any], key: str) -> int:
    value = span.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{key} must be an integer, got {value!r:.60}")
    return int(value)


def spans_of_json(document: object) -> Iterable[FileSpan]:
    """The spans of one OTLP/JSON ``ExportTraceServiceRequest``, or of a trace API's answer holding one
    (Tempo's ``/api/traces/<id>`` and ``/api/v2/traces/<id>``, Jaeger's ``/api/v3/traces/<id>``); raises
    ``ValueError`` if it is neither."""
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    for resource_spans in _resource_spans(document):
        if not isinstance(resource_spans, dict):
            raise ValueError("resourceSpans must hold objects")
        resource_node = resource_spans.get("resource", {})
        resource = _json_attributes(_list(resource_node, "attributes")) if isinstance(resource_node, dict) else {}
        # Older OTLP (and Tempo before 2.0) names them instrumentationLibrarySpans.
        for scope_spans in _list(resource_spans, "scopeSpans") + _list(resource_spans, "instrumentationLibrarySpans"):
            if not isinstance(scope_spans, dict):
                raise ValueError("scopeSpans must hold objects")
            for span in _list(scope_spans, "spans"):
                if not isinstance(span, dict) or not isinstance(span.get("name", ""), str):
                    raise ValueError(f"not a span: {span!r:.60}")
                status = span.get("status", {})
                if not isinstance(status, dict):
                    raise ValueError("status must be an object")
                exception = _exception_fields(next(
                    (_json_attributes(_list(event, "attributes")) for event in _list(span, "events")
                     if isinstance(event, dict) and event.get("name") == "exception"), None))  # fmt: skip
                yield FileSpan(
                    trace_id=_json_id(span, "traceId", 16),
                    span_id=_json_id(span, "spanId", 8),
                    parent_id=_json_id(span, "parentSpanId", 8),
                    name=span.get("name", ""),
                    start_ns=_json_time(span, "startTimeUnixNano"),
                    end_ns=_json_time(span, "endTimeUnixNano"),
                    error=status.get("code") in (STATUS_ERROR, "STATUS_CODE_ERROR"),
                    status_message=str(status.get("message", "")),
                    attributes=_json_attributes(_list(span, "attributes")),
                    resource=resource,
                    **exception,
                )


def read_spans(paths: Iterable[str | os.PathLike[str]], damaged: list[str] | None = None) -> list[FileSpan]:
    """Every span in the files (a folder: its ``*.json(l)`` files; a spool: its records, :func:`read_spool`).

    ``damaged``: read on past what a killed writer leaves (an empty file, a line cut short), described there.

    Raises:
        SpanFileError: a file is missing, not OTLP JSON, or (without ``damaged``) empty or cut short.
    """
    files: list[Path] = []
    spans: list[FileSpan] = []
    notes = damaged if damaged is not None else []
    for raw in paths:
        path = Path(raw)
        if record_directories(str(path)):  # a spool: what processes wrote ahead before they died
            spans.extend(spans_of(encode_spans(read_spool(str(path), notes))))
        elif path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in {".json", ".jsonl"}))
        else:
            files.append(path)
    if not files and not spans:
        raise SpanFileError("no trace files given (or the folder has no .json/.jsonl files, nor records of a spool)")
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpanFileError(f"{path}: cannot read it ({exc})") from None
        for line, document in _documents(path, text, damaged):
            try:
                spans.extend(spans_of_json(document))
            except ValueError as exc:
                raise SpanFileError(f"{path}:{line}: not an OTLP JSON trace request ({exc})") from None
    return _as_delivered(spans, notes)


def _as_delivered(spans: list[FileSpan], notes: list[str]) -> list[FileSpan]:
    """``spans`` as a pipeline may deliver them, made safe to read: each span once (at-least-once delivery, a
    file given twice), no number that is not finite (read as absent), no parent chain that loops (cut where it
    closes). Each kind of repair is said once in ``notes``."""
    unique = list({(s.trace_id, s.span_id): s for s in reversed(spans)}.values())[::-1]  # the first of each
    if len(unique) < len(spans):
        notes.append(f"{len(spans) - len(unique)} spans were read more than once (an exporter's retry delivered "
                     "them again, or a file was given twice): each is counted once")  # fmt: skip
    dropped = 0
    for span in unique:
        bad = [key for key, value in span.attributes.items() if not _finite(value)]
        for key in bad:
            del span.attributes[key]
        dropped += len(bad)
    if dropped:
        notes.append(f"{dropped} attributes held a number that is not finite (NaN, Infinity): read as absent")
    cut = _cut_cycles(unique)
    if cut:
        notes.append(f"{cut} spans' parents led back to themselves (a parent cycle): read as roots")
    return unique


def _finite(value: object) -> bool:
    return math.isfinite(value) if isinstance(value, float) else not isinstance(value, list) or all(map(_finite, value))


def _cut_cycles(spans: list[FileSpan]) -> int:
    """Make every span whose parent chain loops back a root; how many were cut. Linear: each span is walked once."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    done: set[tuple[str, str]] = set()
    cut = 0
    for span in spans:
        path: list[FileSpan] = []
        on_path: set[tuple[str, str]] = set()
        current: FileSpan | None = span
        while current is not None and (key := (current.trace_id, current.span_id)) not in done:
            if key in on_path:  # the chain came back to a span on it: the last link closes the loop
                path[-1].parent_id = ""
                cut += 1
                break
            on_path.add(key)
            path.append(current)
            current = by_id.get((current.trace_id, current.parent_id)) if current.parent_id else None
        done.update(on_path)
    return cut


def _glued(line: str) -> object | None:
    """The document after a cut prefix on ``line``: a restarted writer's first line, appended to a cut one."""
    start = line.find('{"resourceSpans"', 1)
    while start > 0:
        try:
            found: object = json.loads(line[start:])
            return found
        except (json.JSONDecodeError, RecursionError):
            start = line.find('{"resourceSpans"', start + 1)
    return None


def _documents(path: Path, text: str, damaged: list[str] | None = None) -> list[tuple[int, object]]:
    """The JSON documents of a file: one per line, or the whole file as one (pretty-printed) document."""
    if not text.strip():
        if damaged is None:
            raise SpanFileError(f"{path}: the file is empty")
        damaged.append(f"{path}: the file is empty (its process ended before it exported a span?); skipped")
        return []
    try:
        return [(1, json.loads(text))]
    except json.JSONDecodeError:
        pass
    except RecursionError:  # JSON nested deeper than Python's parser goes: not a trace file
        raise SpanFileError(f"{path}: not an OTLP JSON trace request (JSON nested too deep)") from None
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            documents.append((number, json.loads(line)))
        except RecursionError:
            raise SpanFileError(f"{path}:{number}: not an OTLP JSON trace request (JSON nested too deep)") from None
        except json.JSONDecodeError as exc:
            glued = _glued(line)
            if glued is not None and damaged is not None:  # a killed writer's cut line, a restarted one's document after
                documents.append((number, glued))
                damaged.append(f"{path}:{number}: a line cut short, the next writer's line glued onto it (a process "
                               "ended mid-write, then another appended: a restart); read the part after the cut")
                continue
            last = number == len(text.splitlines())
            if last and damaged is not None and not text.endswith("\n"):  # its writer ended mid-line
                damaged.append(f"{path}:{number}: the last line is cut short (its writer ended mid-write); read up to it")
                break
            if not last and damaged is not None and (documents or line.startswith('{"resourceSpans"')):  # (a restart's)
                damaged.append(f"{path}:{number}: the line is cut short and more follows (a process ended mid-write, "
                               "then another appended to the file: a restart); read past it")
                continue
            cut = " (the file looks cut short)" if last else ""
            raise SpanFileError(f"{path}:{number}: not JSON{cut}: {exc.msg}") from None
    return documents
