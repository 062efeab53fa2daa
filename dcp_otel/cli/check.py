"""``dcp-otel check``: would OpenTelemetry's zero-code set-up work here? One line per answer.

``opentelemetry-instrument`` configures the SDK from the ``OTEL_*`` variables
*before* it loads any instrumentor. When that fails (typically an exporter that
is not installed, such as the gRPC one opentelemetry-distro defaults to), it
logs a traceback and loads no instrumentor at all, dcp-otel's included: the job
trains on untraced and dcp-otel never runs to say so. So the same set-up is run
here, in a child process with this environment, before the job:

- ``dcp-otel check`` prints what the set-up gives (span exporter and endpoint,
  metric exporter, dcp-otel's instrumentor), probes the span exporter with an
  empty export (a Collector answers it like any other), and exits 1 with a
  one-line reason and fix when spans would not leave the process;
- ``dcp-otel-run`` under ``opentelemetry-instrument`` runs the set-up (no probe)
  before torchrun and says in one line when the workers' set-up will fail.

Usage::

    export OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318
    dcp-otel check          # exit 0: spans will reach the Collector; 1: the line says why not

    from dcp_otel.cli.check import check_otel_setup
    problems = check_otel_setup(probe=False).problems()
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from dcp_otel.config import traces_off

#: The name dcp-otel's instrumentor has in the ``opentelemetry_instrumentor`` entry points.
INSTRUMENTOR_NAME = "torch_dcp"

# Run in a child: opentelemetry-instrument's own steps (distro, then configurators), which set
# process-wide providers that must not be set in the caller.
_CHILD = r"""
import json, sys
probe = sys.argv[1] == "probe"
try:
    from opentelemetry.instrumentation.auto_instrumentation import _load
    distro = _load._load_distro()
    distro.configure()
    _load._load_configurators()
except Exception as exc:
    print(json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
from opentelemetry import metrics, trace
provider = trace.get_tracer_provider()
found = {"provider": type(provider).__name__, "span_exporters": [], "metric_exporters": [],
         "sdk_disabled": bool(getattr(provider, "_disabled", False)),
         "sampler": getattr(getattr(provider, "sampler", None), "get_description", lambda: None)()}
for processor in getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ()):
    exporter = getattr(processor, "span_exporter", None) or getattr(getattr(processor, "_batch_processor", None), "_exporter", None)
    if exporter is None:
        continue
    entry = {"name": type(exporter).__name__, "endpoint": getattr(exporter, "_endpoint", None)}
    if probe:
        try:
            entry["probe"] = exporter.export([]).name
        except Exception as exc:
            entry["probe"] = f"{type(exc).__name__}: {exc}"
        if entry["probe"] != "SUCCESS" and entry["endpoint"]:  # name the network's answer, which exporters may not log
            import socket, urllib.parse
            url = urllib.parse.urlsplit(entry["endpoint"])
            try:
                socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), 3).close()
            except OSError as exc:
                entry["connect_error"] = str(exc)
    found["span_exporters"].append(entry)
readers = getattr(metrics.get_meter_provider(), "_metric_readers", ())
found["metric_exporters"] = [type(getattr(r, "_exporter", r)).__name__ for r in readers]
print(json.dumps(found))
"""


@dataclass
class SetupCheck:
    """What OpenTelemetry's zero-code set-up gives in this environment."""

    setup_error: str | None = None
    provider: str | None = None
    span_exporters: list[dict[str, Any]] = field(default_factory=list)
    metric_exporters: list[str] = field(default_factory=list)
    instrumentor: bool = True
    instrumentor_disabled: bool = False
    probe_log: str = ""
    sdk_disabled: bool = False  # OTEL_SDK_DISABLED=true: the provider makes no-op spans
    sampler: str | None = None  # the provider's sampler, as it describes itself

    def problems(self) -> list[str]:
        """Why spans would not leave the process, one line each with its fix; empty when they would."""
        found: list[str] = []
        if self.setup_error is not None:
            found.append(f"OpenTelemetry's set-up fails, so no instrumentor (dcp-otel's included) would run: "
                         f"{self.setup_error}{fix_for(self.setup_error)}")  # fmt: skip
            return found
        if not self.instrumentor:
            found.append(f"dcp-otel's instrumentor ({INSTRUMENTOR_NAME}) is not installed in {sys.executable}'s environment")
        elif self.instrumentor_disabled:
            found.append(f"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS turns dcp-otel's instrumentor ({INSTRUMENTOR_NAME}) off")
        if self.provider in (None, "ProxyTracerProvider", "NoOpTracerProvider"):
            found.append("no tracer provider is set up (no configurator: pip install opentelemetry-distro)")
        elif not self.span_exporters and not traces_off():
            found.append("the tracer provider has no span exporter (set OTEL_TRACES_EXPORTER, e.g. otlp)")
        if self.sdk_disabled:
            found.append("OTEL_SDK_DISABLED=true: the SDK makes no spans, so none is exported (unset it)")
        elif drops_every_span(self.sampler):
            said = str(self.sampler) if len(str(self.sampler)) < 40 else str(self.sampler).split(",")[0] + ",...}"
            found.append(f"the sampler drops every trace a job starts ({said}): set OTEL_TRACES_SAMPLER="
                         "parentbased_always_on (the default), or parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG "
                         "above 0")  # fmt: skip
        for exporter in self.span_exporters:
            result = exporter.get("probe")
            if result is not None and result != "SUCCESS":
                why = exporter.get("connect_error") or probe_failure(self.probe_log) or str(result)
                found.append(f"{exporter['name']} could not export to {exporter.get('endpoint') or 'its endpoint'}: {why}")
        return found

    def lines(self) -> list[str]:
        """The answers, for a terminal."""
        out = [f"python: {sys.executable}"]
        if self.setup_error is not None:
            out.append(f"set-up: failed: {self.setup_error}")
            return out
        out.append("set-up: ok")
        if traces_off():
            out.append("spans: not exported (OTEL_TRACES_EXPORTER=none)")
        for exporter in self.span_exporters:
            where = f" -> {exporter['endpoint']}" if exporter.get("endpoint") else ""
            probe = exporter.get("probe")
            said = "" if probe is None else ": reached (an empty export was accepted)" if probe == "SUCCESS" else ": not reached"
            out.append(f"spans: {exporter['name']}{where}{said}")
        out.append(f"metrics (OTLP path): {', '.join(self.metric_exporters) or 'none'}")
        state = "not installed" if not self.instrumentor else "disabled" if self.instrumentor_disabled else "installed"
        out.append(f"dcp-otel instrumentor ({INSTRUMENTOR_NAME}): {state}")
        return out


def check_otel_setup(*, probe: bool = True, timeout_s: float = 60.0, env: dict[str, str] | None = None) -> SetupCheck:
    """Run opentelemetry-instrument's set-up in a child process with ``env`` (default: this one's).

    ``probe`` sends each span exporter an empty export (an OTLP exporter waits up
    to ``OTEL_EXPORTER_OTLP_TIMEOUT`` for a dead endpoint). Never raises for what
    the set-up does; the answer says it.
    """
    child_env = dict(os.environ if env is None else env)
    auto = _auto_instrumentation_dir()
    if auto and child_env.get("PYTHONPATH"):  # the child runs the set-up itself, once, not also in sitecustomize
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in child_env["PYTHONPATH"].split(os.pathsep) if p != auto)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, "probe" if probe else "set-up"], capture_output=True,
                              text=True, timeout=timeout_s, env=child_env)  # fmt: skip
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return SetupCheck(setup_error=f"the check could not run: {exc}")
    if not answer:
        return SetupCheck(setup_error=f"the check's child failed: {_last_line(done.stderr) or done.returncode}")
    found = SetupCheck(**{k: answer[k] for k in ("setup_error", "provider", "span_exporters", "metric_exporters",
                                                         "sdk_disabled", "sampler")
                          if k in answer}, probe_log=done.stderr)  # fmt: skip
    names = {ep.name for ep in entry_points(group="opentelemetry_instrumentor")}
    found.instrumentor = INSTRUMENTOR_NAME in names
    disabled = child_env.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    found.instrumentor_disabled = INSTRUMENTOR_NAME in {n.strip() for n in disabled.split(",")} or disabled.strip() == "*"
    return found


def drops_every_span(sampler: str | None) -> bool:
    """Whether a sampler, as the SDK describes it, samples no trace a job starts (its root spans): always off, or a
    trace-id ratio of 0, alone or as the root of a parent-based sampler."""
    root = re.match(r"ParentBased\{root:([^,]*)", sampler or "")
    decides = root.group(1) if root else (sampler or "")
    return decides == "AlwaysOffSampler" or bool(re.fullmatch(r"TraceIdRatioBased\{0(\.0*)?\}", decides))


def fix_for(error: str) -> str:
    """The fix for a set-up error we know, as a clause to append ("" when unknown)."""
    missing = re.search(r"Requested component '([^']+)' not found", error)
    if missing and missing.group(1) == "otlp_proto_grpc":
        return ("; the OTLP protocol defaults to gRPC, whose exporter is not installed: set "
                "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (dcp-otel[otlp] installs the HTTP exporter) "
                "or pip install opentelemetry-exporter-otlp-proto-grpc")  # fmt: skip
    if missing:
        return f"; no exporter named {missing.group(1)!r} is installed in this environment"
    return ""


def under_opentelemetry_instrument(env: dict[str, str] | None = None) -> bool:
    """Whether processes started with ``env`` run opentelemetry-instrument's set-up (its sitecustomize)."""
    auto = _auto_instrumentation_dir()
    path = (os.environ if env is None else env).get("PYTHONPATH", "")
    return bool(auto) and auto in path.split(os.pathsep)


def warn_if_workers_setup_fails(prog: str) -> str | None:
    """For a launcher under opentelemetry-instrument: one stderr line when its workers' set-up will fail."""
    if not under_opentelemetry_instrument():
        return None
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None  # the launcher's own set-up (same environment as its workers') worked: nothing to run
    problems = check_otel_setup(probe=False).problems()
    if not problems:
        return None
    line = f"{prog}: warning: the workers will run without telemetry: {problems[0]}"
    print(line, file=sys.stderr, flush=True)
    return line


def _auto_instrumentation_dir() -> str | None:
    try:
        from opentelemetry.instrumentation import auto_instrumentation
    except ImportError:
        return None
    return os.path.dirname(os.path.abspath(auto_instrumentation.__file__))


def probe_failure(log: str) -> str:
    """Why an export failed, from what the exporter logged: the OS error when there is one."""
    os_error = re.search(r"\[Errno -?\d+\] [^\"')]+", log)
    if os_error:
        return os_error.group(0).strip()
    errors = [line.strip() for line in log.splitlines() if "rror" in line or "status" in line.lower()]
    return (errors[0] if errors else _last_line(log))[:300]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
