"""What a signal handler raises is the application's: dcp-otel's ``except Exception`` never swallows it.

torchelastic's agent stops on SIGTERM by raising ``SignalException`` from its handler, in
whatever the main thread runs then; the agent's loop spends part of each 0.1 s in
``OTelMetricHandler``. Swallowed there, the scheduler's SIGTERM left the job running (seen once
in CI: ``dcp-otel-run`` never ended after SIGTERM). Each test here makes the signal land inside
dcp-otel's own code, deterministically: the signal is sent from code that runs inside our ``try``.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from torch.distributed.elastic.metrics.api import MetricData
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

from dcp_otel import OTelMetricHandler, _selftelemetry, semconv
from dcp_otel.live.signal_exceptions import raised_by_signal_handler
from tests.ranks import REPO


class Preempted(Exception):
    """What an application's own SIGUSR1 handler raises (a requeue handler, a framework's)."""


@pytest.fixture
def handler_of() -> Iterator[Callable[[int, Any], None]]:
    """Install a handler for SIGUSR1 (SIGTERM for torch's); the previous one is put back after the test."""
    installed: list[tuple[int, Any]] = []

    def install(signum: int, handler: Any) -> None:
        installed.append((signum, signal.signal(signum, handler)))

    yield install  # type: ignore[misc]
    for signum, previous in reversed(installed):
        signal.signal(signum, previous)


def signal_now(signum: int = signal.SIGUSR1) -> None:
    """Deliver ``signum`` to this process; Python runs its handler at the next bytecode, here."""
    os.kill(os.getpid(), signum)


def raise_preempted(signum: int, frame: Any) -> None:
    raise Preempted(f"signal {signum}")


def caught_from(raising: Callable[[], None]) -> BaseException:
    try:
        raising()
    except BaseException as exc:  # noqa: BLE001 - the test looks at what was raised
        return exc
    raise AssertionError("nothing was raised")


def dropped(registry: CollectorRegistry) -> float | None:
    """How many metrics the handler dropped for an error of its own."""
    return registry.get_sample_value(f"{semconv.METRIC_ELASTIC_DROPPED}_total", {semconv.LABEL_REASON: "handler_error"})


# --- the agent: torchelastic's own handler, the metric handler the launcher configures ---------------
def test_sigterm_reaching_the_agent_inside_the_metric_handler_stops_the_agent(handler_of: Any) -> None:
    handler_of(signal.SIGTERM, _terminate_process_handler)  # what torchelastic's agent installs

    def scheduler_stops_the_job(group: str, name: str, value: float, timestamp: float) -> bool:
        signal_now(signal.SIGTERM)
        return False

    registry = CollectorRegistry()
    metrics = OTelMetricHandler(registry, rules=[scheduler_stops_the_job], metrics="prometheus")
    with pytest.raises(SignalException):  # as the agent's loop raises it without dcp-otel: it then stops its workers
        metrics.emit(MetricData(time.time(), "workers", "default.healthy", 1))
    assert dropped(registry) is None


def test_an_ordinary_error_inside_the_metric_handler_is_still_counted_and_never_raised() -> None:
    def broken(group: str, name: str, value: float, timestamp: float) -> bool:
        raise Preempted("a rule with a bug")  # the same type, raised by code, not by a signal handler

    registry = CollectorRegistry()
    OTelMetricHandler(registry, rules=[broken], metrics="prometheus").emit(MetricData(time.time(), "workers", "x", 1))
    assert dropped(registry) == 1


# --- a worker: the application's handler, fired while dcp-otel reports a problem of its own -----------
def test_an_applications_signal_exception_raised_while_dcp_otel_reports_reaches_the_application(handler_of: Any) -> None:
    handler_of(signal.SIGUSR1, raise_preempted)

    class SignalsOnWarning(logging.Handler):  # the application's logging: it runs inside report()'s try
        def emit(self, record: logging.LogRecord) -> None:
            signal_now()

    logger = logging.getLogger("dcp_otel")
    sink = SignalsOnWarning()
    logger.addHandler(sink)
    try:
        with pytest.raises(Preempted):
            _selftelemetry.report(f"test_signal_{time.monotonic_ns()}", "a problem of dcp-otel's own")
    finally:
        logger.removeHandler(sink)


# --- which exceptions count as a signal handler's --------------------------------------------------
class Requeue:
    def on_signal(self, signum: int, frame: Any) -> None:
        raise Preempted("method")

    def __call__(self, signum: int, frame: Any) -> None:
        raise Preempted("callable object")


def _helper_raising() -> None:
    raise Preempted("helper")


def _handler_calling_a_helper(signum: int, frame: Any) -> None:
    _helper_raising()


def _with_tag(tag: str, signum: int, frame: Any) -> None:
    raise Preempted(tag)


@pytest.mark.parametrize("handler", [raise_preempted, Requeue().on_signal, Requeue(), functools.partial(_with_tag, "p"),
                                     _handler_calling_a_helper],
                         ids=["function", "bound method", "callable object", "partial", "raised in a helper"])  # fmt: skip
def test_an_exception_out_of_any_kind_of_python_handler_is_the_signals(handler_of: Any, handler: Any) -> None:
    handler_of(signal.SIGUSR1, handler)

    def our_code() -> None:
        signal_now()

    assert raised_by_signal_handler(caught_from(our_code))


def _one_shot(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)  # restores the previous disposition before it raises (a timeout's way)
    raise TimeoutError("one shot")


def _rewrapped(handler: Callable[[int, Any], None]) -> Callable[..., None]:
    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> None:  # a decorator around the application's handler
        handler(*args, **kwargs)

    return wrapper


class _Dropping:
    def __call__(self, signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise Preempted("no longer installed, and called through an object")


@pytest.mark.parametrize("handler", [_one_shot, _rewrapped(_one_shot), _Dropping()],
                         ids=["one-shot", "re-wrapped one-shot", "one-shot callable object"])  # fmt: skip
def test_a_handler_no_longer_installed_when_the_clause_looks_is_still_told(handler_of: Any, handler: Any) -> None:
    handler_of(signal.SIGUSR1, handler)

    def our_code() -> None:
        signal_now()
        for _ in range(10):  # (where the handler runs)
            pass

    caught = caught_from(our_code)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # gone when the clause asks
    assert raised_by_signal_handler(caught)


def test_a_one_shot_timeout_inside_a_dcp_step_reaches_the_application(handler_of: Any, traced: Any,
                                                                         tmp_path: Any) -> None:  # fmt: skip
    """The case a user met: SIGALRM's one-shot handler firing as dcp-otel detaches a step's context (on the hot
    path, inside its ``try``), swallowed and logged as "failed to detach a DCP call's context"."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_otel.tracing import tracker

    handler_of(signal.SIGALRM, _one_shot)
    detach = tracker.light_detach

    fired: list[bool] = []

    def detach_as_the_alarm_fires(token: Any) -> None:
        if not fired:  # (once: the handler then restores SIGALRM's default, which would end the test's process)
            fired.append(True)
            signal_now(signal.SIGALRM)
        detach(token)

    tracker.light_detach = detach_as_the_alarm_fires  # the alarm lands in dcp-otel's own clause
    try:
        with pytest.raises(BaseException) as raised:  # noqa: PT011 - torch may wrap it: the cause is what counts
            dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "c"))
    finally:
        tracker.light_detach = detach
    chain = [raised.value, *getattr(raised.value, "failures", {}).values()]
    assert any("one shot" in repr(item) for item in chain), repr(raised.value)
    assert "recorder_error" not in _selftelemetry.counts()


def test_a_handlers_exception_while_dcp_otel_asks_the_sdk_for_its_tracer_reaches_the_application(
    handler_of: Any, tmp_path: Any,
) -> None:
    """The SDK's get_tracer catches whatever its tracer configurator raises (what the CI saw: an alarm landing
    there at the first checkpoint, swallowed and logged by the SDK). dcp-otel asks it off the main thread, where no
    handler runs; the signal lands in dcp-otel's wait instead, and passes through."""
    import torch
    import torch.distributed.checkpoint as dcp
    from opentelemetry.sdk.trace import TracerProvider, _TracerConfig

    import dcp_otel

    handler_of(signal.SIGUSR1, raise_preempted)

    def configurator(scope: Any) -> Any:
        signal_now()  # (from the thread that asks: the handler runs on the main thread, wherever it is then)
        return _TracerConfig.default()

    provider = TracerProvider(_tracer_configurator=configurator)
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    try:
        with pytest.raises(BaseException) as raised:  # noqa: PT011 - torch may wrap it: the cause is what counts
            dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "c"))
    finally:
        dcp_otel.uninstrument()
    chain = [raised.value, *getattr(raised.value, "failures", {}).values()]
    assert any(isinstance(item, Preempted) or "Preempted" in repr(item) for item in chain), repr(raised.value)


def test_an_exception_our_code_raised_is_not_the_signals_even_with_a_handler_installed(handler_of: Any) -> None:
    handler_of(signal.SIGUSR1, raise_preempted)
    assert not raised_by_signal_handler(caught_from(_helper_raising))


def test_a_handler_catching_its_own_error_does_not_take_it_for_a_signals(handler_of: Any) -> None:
    seen: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        try:
            _helper_raising()  # an ordinary error inside the handler, caught by the handler's own clause
        except Preempted as exc:
            seen.append(raised_by_signal_handler(exc))

    handler_of(signal.SIGUSR1, handler)
    signal_now()
    assert seen == [False]


def test_a_handlers_function_called_on_another_thread_is_no_signal(handler_of: Any) -> None:
    handler_of(signal.SIGUSR1, raise_preempted)
    found: list[bool] = []

    def call_it() -> None:
        found.append(raised_by_signal_handler(caught_from(lambda: raise_preempted(0, None))))

    worker = threading.Thread(target=call_it)
    worker.start()
    worker.join()
    assert found == [False]


# --- every clause of the library asks ---------------------------------------------------------------
#: (module, function) whose broad clause decides about signals itself: away_from_signals' helper thread hands
#: whatever it caught to the caller, which raises it on its own thread.
EXEMPT = {("live/signal_exceptions.py", "run")}


def _broad(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(n is None or (isinstance(n, ast.Name) and n.id in ("Exception", "BaseException")) for n in names)


def _lets_signals_through(handler: ast.ExceptHandler) -> bool:
    first = handler.body[0]
    asks = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and getattr(first.value.func, "id", None) == "reraise_if_signalled"
            and handler.name is not None and [getattr(a, "id", None) for a in first.value.args] == [handler.name])  # fmt: skip
    reraises = any(isinstance(node, ast.Raise) and node.exc is None for node in handler.body)
    return asks or reraises


def swallowing_clauses(source: str, module: str) -> list[str]:
    """``module:line (function)`` of each broad except clause that neither asks nor re-raises."""
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ExceptHandler) and _broad(child) and not _lets_signals_through(child) \
                    and (module, function) not in EXEMPT:  # fmt: skip
                found.append(f"{module}:{child.lineno} ({function})")
            visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function)

    visit(ast.parse(source), "<module>")
    return found


def test_every_broad_except_clause_in_the_library_lets_a_signal_handlers_exception_through() -> None:
    """``except Exception`` (or ``BaseException``) either asks ``reraise_if_signalled`` first or re-raises.
    Left out: the demo, an application of ours."""
    package = REPO / "dcp_otel"
    offenders = [found for path in sorted(package.rglob("*.py")) if not path.relative_to(package).as_posix().startswith("demo/")
                 for found in swallowing_clauses(path.read_text(), path.relative_to(package).as_posix())]  # fmt: skip
    assert not offenders, "broad except clauses that would swallow a signal handler's exception:\n" + "\n".join(offenders)


def test_the_check_finds_a_clause_that_swallows() -> None:
    source = """
def record():
    try:
        work()
    except Exception:
        report()
    try:
        work()
    except (ValueError, BaseException) as exc:
        reraise_if_signalled(other)
    try:
        work()
    except Exception as exc:
        reraise_if_signalled(exc)
        report()
    try:
        work()
    except BaseException:
        cleanup()
        raise
"""
    assert swallowing_clauses(source, "m.py") == ["m.py:5 (record)", "m.py:9 (record)"]
