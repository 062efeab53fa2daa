"""Options of :func:`dcp_otel.instrument`, with their environment variables.

Precedence is keyword argument > environment variable > default, as in the
OpenTelemetry instrumentations. A bad keyword is a :class:`ValueError` at
configuration time; a bad environment variable (which the user may not control
from the training script) gets a clear warning and the default.

Usage::

    options = InstrumentOptions.from_kwargs({"run_id": "job-42"})
    options.slowest_keys   # -> 5, or $DCP_OTEL_SLOWEST_KEYS if set and valid
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from dcp_otel import semconv
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.detail import DETAIL_MODES, DetailMode
from dcp_otel.tracing.training_step import DEFAULT_STEP_PATTERN, compiled

logger = logging.getLogger("dcp_otel")


@dataclass(frozen=True)
class InstrumentOptions:
    """What :func:`dcp_otel.instrument` accepts.

    Attributes:
        tracer_provider: where spans go; ``None`` means the global provider, so
            ``opentelemetry-instrument`` and SDKs configured by the user just work.
        registry: the ``prometheus_client`` registry checkpoint metrics are
            recorded in; ``None`` means the global ``REGISTRY``.
        metrics_port: when set (or ``$DCP_OTEL_METRICS_PORT``), instrument()
            also serves the metrics on ``metrics_port + LOCAL_RANK`` (bind
            address ``$DCP_OTEL_METRICS_ADDR``, else all interfaces), so a
            training script needs no code for it; see
            :func:`dcp_otel.start_metrics_server`.
        run_id: identifies this job run in trace ids, so that two runs saving
            to the same checkpoint id never share a trace. ``None``: taken from
            ``$DCP_OTEL_RUN_ID``, then ``$TORCHELASTIC_RUN_ID`` (torchrun's
            ``--rdzv-id``), then ``$SLURM_JOB_ID``; see :mod:`dcp_otel.tracing.trace_ids`.
        slowest_keys: how many of the slowest state-dict keys to name on the
            ``dcp._stateful_to_state_dict`` span (0 to 100).
        max_open_spans: bound on DCP spans open at once in this process; past it
            new spans are dropped and counted, so a torch that never logs an
            end event cannot grow memory without limit.
        process_setup: ``"module:function"`` run first in torch's async
            checkpoint daemon (``AsyncCheckpointerType.PROCESS``) to configure
            its tracing; it returns the ``TracerProvider`` the daemon's spans go
            to (or ``None`` after setting the global one). Only needed when the
            training script configures its exporter in code: without it the
            daemon uses an SDK already set up there (``opentelemetry-instrument``),
            else one built from the ``OTEL_*`` variables it inherits. See
            :mod:`dcp_otel.processes.daemon`.
        flush_timeout_s: the longest dcp-otel waits for the exporter when it
            flushes on its own: at interpreter exit, and in the daemon after each
            save (0 disables both).
        detail: ``"full"`` exports every step span of every rank; ``"auto"``
            (the default) has every rank export its operation span with a
            summary of its steps, and step spans only from the coordinator,
            failed ranks, stragglers, ranks slower than their own median and a
            1-in-K sample sized by ``span_budget``. Up to about
            ``span_budget / 8`` ranks the sample is every rank, which is ``full``.
            See :mod:`dcp_otel.tracing.detail`.
        span_export: who exports the checkpoint spans. ``"process"`` (the
            default): this process, through its tracer provider. ``"node"``:
            the survivor of torchelastic's agent (``dcp-otel-run``, or ``torchrun``
            under ``opentelemetry-instrument``), through the agent's exporters:
            this process writes each checkpoint's spans into its record in the
            spool and makes no SDK span and no export request for them, which
            takes their cost off the training steps (docs/performance.md). The
            spans reach the backend within about a second of being built; a
            stall's span and the process's span at its exit are still sent by
            the process. Needs the spool (``$DCP_OTEL_SPOOL_DIR``). See
            :mod:`dcp_otel.spool.spans`.
        span_budget: the step spans one checkpoint may carry across all ranks
            in ``auto`` mode, in a balanced job (16 to 10,000,000).
        max_queued_operations: finished operations waiting for the background
            builder; past it an operation's spans and metrics are dropped and
            counted (``build_queue_full``), never waited for.
        meter_provider: where the OpenTelemetry side of the metrics goes;
            ``None`` means the global provider (which ``opentelemetry-instrument``
            sets from ``OTEL_METRICS_EXPORTER``), so OTLP push needs no code.
        metrics: where checkpoint metrics are recorded: ``"prometheus"``
            (prometheus-client: the scrape endpoint, multiprocess files),
            ``"opentelemetry"`` (the metrics API: OTLP push, or whatever the
            meter provider exports), both (``"prometheus,opentelemetry"``)
            or ``"none"``; a string or a sequence. Not given:
            ``$DCP_OTEL_METRICS``, else Prometheus, plus OpenTelemetry when
            ``meter_provider`` is given or ``$OTEL_METRICS_EXPORTER`` names an
            exporter (see :func:`default_metric_sinks`).
        stall_after_s: seconds an open DCP call may go without progress (no step
            starting or ending) before the watchdog reports it stalled: a
            ``dcp.stall`` span with the stuck thread's stack, ``dcp_stalls_total``
            and a warning, again at twice the time, four times, ... while it
            lasts. ``None`` (the default, ``$DCP_OTEL_STALL_AFTER_S=auto``):
            from the operation's own history, 3 times the slowest of its last 20
            successful runs in this process, at least 60 s; 300 s before it has
            any. ``0`` (``off``): no stall reports (the live progress gauge
            stays). See :mod:`dcp_otel.live.watchdog`.
        step_pattern: how the training step (``dcp.training.step``) is read from a checkpoint id's last path
            component when the training loop did not say it (:func:`dcp_otel.set_training_step`): a regular
            expression whose group ``step`` (or first group) is the number, or ``"off"``. Default
            (``$DCP_OTEL_STEP_PATTERN``, else): ``step-1000``, ``step_1000``, ``iter_0001000``,
            ``global_step1000``, ``checkpoint-500``, ``epoch=0-step=100.ckpt``, ``1000``. See
            :mod:`dcp_otel.tracing.training_step`.
    """

    tracer_provider: TracerProvider | None = None
    registry: CollectorRegistry | None = None
    metrics_port: int | None = None
    run_id: str | None = None
    slowest_keys: int = 5
    max_open_spans: int = 10_000
    process_setup: str | None = None
    flush_timeout_s: int = 10
    detail: DetailMode = "auto"
    span_budget: int = 2000
    span_export: str = semconv.SPAN_EXPORT_PROCESS
    max_queued_operations: int = 4096
    meter_provider: MeterProvider | None = None
    metrics: tuple[str, ...] = (semconv.SINK_PROMETHEUS,)
    stall_after_s: float | None = None
    step_pattern: str = DEFAULT_STEP_PATTERN

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", metric_sinks(self.metrics))
        if self.meter_provider is not None and not isinstance(self.meter_provider, MeterProvider):
            raise ValueError(f"meter_provider must be an opentelemetry MeterProvider, got "
                             f"{type(self.meter_provider).__name__}")  # fmt: skip
        if self.tracer_provider is not None and not isinstance(self.tracer_provider, TracerProvider):
            raise ValueError(f"tracer_provider must be an opentelemetry TracerProvider, got "
                             f"{type(self.tracer_provider).__name__}")  # fmt: skip
        if self.registry is not None and not isinstance(self.registry, CollectorRegistry):
            raise ValueError(f"registry must be a prometheus_client CollectorRegistry, got {type(self.registry).__name__}")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id.strip()):
            raise ValueError(f"run_id must be a non-empty string, got {self.run_id!r}")
        _check_int("slowest_keys", self.slowest_keys, 0, 100)
        if self.metrics_port is not None:
            _check_int("metrics_port", self.metrics_port, 0, 65535)
        _check_int("max_open_spans", self.max_open_spans, 16, 10_000_000)
        _check_int("flush_timeout_s", self.flush_timeout_s, 0, 600)
        if self.detail not in DETAIL_MODES:
            raise ValueError(f"detail must be one of {list(DETAIL_MODES)}, got {self.detail!r}")
        _check_int("span_budget", self.span_budget, 16, 10_000_000)
        if self.span_export not in semconv.SPAN_EXPORT_MODES:
            raise ValueError(f"span_export must be one of {list(semconv.SPAN_EXPORT_MODES)}, got {self.span_export!r}")
        _check_int("max_queued_operations", self.max_queued_operations, 1, 10_000_000)
        if self.process_setup is not None:
            resolve_callable(self.process_setup)  # a typo fails here, not in the daemon
        if self.stall_after_s is not None and (
            isinstance(self.stall_after_s, bool) or not isinstance(self.stall_after_s, (int, float))
            or not 0 <= self.stall_after_s <= MAX_STALL_AFTER_S
        ):
            raise ValueError(f"stall_after_s must be None (auto) or seconds from 0 (off) to {MAX_STALL_AFTER_S:g}, "
                             f"got {self.stall_after_s!r}")  # fmt: skip
        if not isinstance(self.step_pattern, str):
            raise ValueError(f"step_pattern must be a regular expression or 'off', got {self.step_pattern!r}")
        compiled(self.step_pattern)  # a bad pattern fails here, not at the first checkpoint

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> InstrumentOptions:
        """Build options from keyword arguments, filling the rest from the environment.

        Raises:
            ValueError: an unknown option, or a keyword with a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = _without_retired(kwargs)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown dcp_otel option(s) {unknown}; valid options are {sorted(names)}")
        values = dict(kwargs)
        if values.get("run_id") is None and (env := os.environ.get(semconv.ENV_RUN_ID, "").strip()):
            values["run_id"] = env
        if values.get("process_setup") is None and (env := os.environ.get(semconv.ENV_PROCESS_SETUP, "").strip()):
            try:
                resolve_callable(env)
                values["process_setup"] = env
            except ValueError as exc:
                logger.warning("ignoring %s=%r: %s", semconv.ENV_PROCESS_SETUP, env, exc)
        if values.get("detail") is None and (env := os.environ.get(semconv.ENV_DETAIL, "").strip()):
            if env.lower() in DETAIL_MODES:
                values["detail"] = env.lower()
            else:
                logger.warning("ignoring %s=%r: expected one of %s", semconv.ENV_DETAIL, env, list(DETAIL_MODES))
        if values.get("span_export") is None and (env := os.environ.get(semconv.ENV_SPAN_EXPORT, "").strip()):
            if env.lower() in semconv.SPAN_EXPORT_MODES:
                values["span_export"] = env.lower()
            else:
                logger.warning("ignoring %s=%r: expected one of %s", semconv.ENV_SPAN_EXPORT, env,
                               list(semconv.SPAN_EXPORT_MODES))  # fmt: skip
        if values.get("span_export") is None:
            values.pop("span_export", None)
        if values.get("step_pattern") is None and (env := os.environ.get(semconv.ENV_STEP_PATTERN, "").strip()):
            try:
                compiled(env)
                values["step_pattern"] = env
            except ValueError as exc:
                logger.warning("ignoring %s: %s", semconv.ENV_STEP_PATTERN, exc)
        if values.get("step_pattern") is None:  # None: the default
            values.pop("step_pattern", None)
        values["metrics"] = metric_sinks_from_env(values.get("metrics"), values.get("meter_provider"))
        if "stall_after_s" not in values:
            values["stall_after_s"] = stall_after_from_env()
        for name, env_name, low, high in _INT_ENV:
            if name == "metrics_port" and not is_rank_process():
                # The checkpoint daemon, a DataLoader worker or torchrun itself
                # inherits the rank's environment: the rank serves on that port.
                continue
            if name not in values:
                parsed = env_int(env_name, low, high)
                if parsed is not None:
                    values[name] = parsed
        return cls(**values)


#: Options that no longer do anything: accepted, with one warning, so that a job setting them still starts.
_RETIRED = {"signals": "dcp-otel installs no signal handler any more (a process ends as it would without it; "
                       "what it had open is reported by a survivor from its record: see docs/reliability.md)"}


def _without_retired(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    kept = dict(kwargs)
    for name, why in _RETIRED.items():
        if name in kept:
            kept.pop(name)
            logger.warning("dcp_otel: the option %s= is ignored: %s", name, why)
    if os.environ.get(semconv.ENV_SIGNALS_RETIRED, "").strip() and not _warned_env:
        _warned_env.append(True)
        logger.warning("dcp_otel: %s is ignored: %s", semconv.ENV_SIGNALS_RETIRED, _RETIRED["signals"])
    return kept


_warned_env: list[bool] = []

_INT_ENV = (
    ("metrics_port", semconv.ENV_METRICS_PORT, 0, 65535),
    ("slowest_keys", semconv.ENV_SLOWEST_KEYS, 0, 100),
    ("max_open_spans", semconv.ENV_MAX_OPEN_SPANS, 16, 10_000_000),
    ("flush_timeout_s", semconv.ENV_FLUSH_TIMEOUT_S, 0, 600),
    ("span_budget", semconv.ENV_SPAN_BUDGET, 16, 10_000_000),
    ("max_queued_operations", semconv.ENV_MAX_QUEUED_OPERATIONS, 1, 10_000_000),
)


#: Launchers whose process is not a rank (console script names, ``-m`` modules).
_LAUNCHER_SCRIPTS = frozenset({"torchrun", "dcp-otel-run"})
_LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "dcp_otel.elastic.launcher"})


def is_rank_process() -> bool:
    """False in torchrun itself and in processes ``multiprocessing`` spawned from a rank.

    ``opentelemetry-instrument torchrun ...`` instruments all of them, and they
    all inherit the rank's environment, but only the rank itself should serve
    ``$DCP_OTEL_METRICS_PORT``. Decided from the interpreter's command line
    (``sys.orig_argv``), because this runs in ``sitecustomize``, before
    ``sys.argv`` or multiprocessing are set up.
    """
    argv = getattr(sys, "orig_argv", sys.argv)
    if "--multiprocessing-fork" in argv:  # multiprocessing's spawn / forkserver children
        return False
    if "-c" in argv[:-1] and argv[argv.index("-c") + 1].startswith("from multiprocessing"):
        return False  # its helpers (resource tracker, forkserver) too
    return not is_launcher()


def is_launcher() -> bool:
    """Whether this process is ``torchrun``, ``python -m torch.distributed.run`` or ``dcp-otel-run`` (from its
    command line: this runs in ``sitecustomize``, before ``sys.argv`` is set up)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if len(argv) > 1 and os.path.basename(argv[1]) in _LAUNCHER_SCRIPTS:
        return True
    return len(argv) > 2 and argv[1] == "-m" and argv[2] in _LAUNCHER_MODULES


#: The longest stall threshold accepted: a week.
MAX_STALL_AFTER_S = 7 * 24 * 3600.0
_OFF = frozenset({"off", "false", "0", "no"})


def stall_after_from_env() -> float | None:
    """``$DCP_OTEL_STALL_AFTER_S``: seconds (``0`` or ``off``: no stall reports), else ``None`` (auto).

    A bad value warns and means auto.
    """
    raw = os.environ.get(semconv.ENV_STALL_AFTER_S, "").strip().lower()
    if not raw or raw == "auto":
        return None
    if raw in _OFF:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_STALL_AFTER_S:  # (NaN too)
        logger.warning("ignoring %s=%r: expected auto, off, or seconds from 0 to %g; using auto",
                       semconv.ENV_STALL_AFTER_S, raw, MAX_STALL_AFTER_S)  # fmt: skip
        return None
    return value


def traces_off() -> bool:
    """Whether ``OTEL_TRACES_EXPORTER=none`` says this process wants no traces."""
    return os.environ.get(semconv.ENV_OTEL_TRACES_EXPORTER, "").strip().lower() == "none"


def resolve_callable(spec: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:function"``.

    Raises:
        ValueError: a malformed name, a module that does not import, or no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the import raised, say so plainly
        reraise_if_signalled(exc)
        raise ValueError(f"cannot import {module_name!r} for {spec!r}: {exc}") from exc
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ValueError(f"{spec!r} does not name a callable")
    found: Callable[..., Any] = target
    return found


def metric_sinks(value: object) -> tuple[str, ...]:
    """Where metrics are recorded, as a tuple in catalogue order: ``metric_sinks("opentelemetry")``.

    Accepts a comma-separated string or a sequence of ``"prometheus"`` and
    ``"opentelemetry"``; ``"none"`` (or nothing) for neither.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, str):
        names = [part.strip().lower() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        names = [v.strip().lower() for v in value]
    else:
        raise ValueError(f"metrics must be a string or a sequence of strings, got {value!r}")
    if names == ["none"]:
        names = []
    unknown = sorted(set(names) - set(semconv.ALL_METRIC_SINKS))
    if unknown:
        raise ValueError(f"unknown metrics sink(s) {unknown}: expected a combination of "
                         f"{list(semconv.ALL_METRIC_SINKS)}, or 'none'")  # fmt: skip
    return tuple(sink for sink in semconv.ALL_METRIC_SINKS if sink in names)


def metric_sinks_from_env(value: object | None, meter_provider: object | None = None) -> tuple[str, ...]:
    """Where metrics go: ``value`` checked (raises ``ValueError``), else ``$DCP_OTEL_METRICS`` (a bad
    one warns), else :func:`default_metric_sinks`."""
    if value is not None:
        return metric_sinks(value)
    env = os.environ.get(semconv.ENV_METRICS, "").strip()
    if env:
        try:
            return metric_sinks(env)
        except ValueError as exc:
            logger.warning("ignoring %s=%r: %s", semconv.ENV_METRICS, env, exc)
    return default_metric_sinks(meter_provider)


def default_metric_sinks(meter_provider: object | None = None) -> tuple[str, ...]:
    """Prometheus always; OpenTelemetry too when the user asked for OpenTelemetry metrics.

    That is: a ``meter_provider`` was given, or ``$OTEL_METRICS_EXPORTER`` is
    set to an exporter. Not merely because ``opentelemetry-instrument`` made a
    provider: the distro defaults to an OTLP metric exporter, and a job that
    is scraped and never asked for a push must not start sending a second copy
    of every checkpoint metric to its Collector.
    """
    exporter = os.environ.get(semconv.ENV_OTEL_METRICS_EXPORTER, "").strip().lower()
    if meter_provider is not None or exporter not in ("", "none"):
        return semconv.ALL_METRIC_SINKS
    return (semconv.SINK_PROMETHEUS,)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {value!r}")


def env_int(env_name: str, low: int, high: int) -> int | None:
    """The integer in ``$env_name`` within ``low..high``; ``None`` if unset, or bad (with a warning).

    Every environment variable dcp-otel reads as a number goes through here,
    so a bad value always gets the same clear warning and the caller's default.
    """
    raw = os.environ.get(env_name)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        logger.warning(
            "ignoring %s=%r: expected an integer from %d to %d; using the default", env_name, raw, low, high
        )
        return None
    return value


def differing_options(active: InstrumentOptions, requested: InstrumentOptions) -> dict[str, tuple[Any, Any]]:
    """The options whose requested value differs from the one in force: ``{name: (in force, requested)}``.

    Providers and registries are compared by identity, everything else by value.
    """
    found: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(InstrumentOptions):
        now, asked = getattr(active, f.name), getattr(requested, f.name)
        same = now is asked if f.name in ("tracer_provider", "registry", "meter_provider") else now == asked
        if not same:
            found[f.name] = (now, asked)
    return found
