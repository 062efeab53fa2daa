"""The application's logging configuration cannot silence dcp-otel.

``logging.config.dictConfig``/``fileConfig`` disable every logger that exists
when they run (``disable_existing_loggers=True`` is their default), torch's DCP
logger included, and ``logging.disable(INFO)`` silences every logger below
WARNING. A ``logging.Handler`` on torch's logger then receives nothing: before
the tap (``dcp_otel/attach/logger_tap.py``) every checkpoint vanished from traces and
metrics without a word. Each case runs in its own process: logging
configuration is global.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest

from tests.ranks import REPO, rank_env

SCRIPT = r"""
import json, logging, logging.config, sys, tempfile, textwrap
import torch, torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
import dcp_otel

case, order = sys.argv[1], sys.argv[2]
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
registry = CollectorRegistry()

def configure_logging():
    if case == "dictConfig":
        logging.config.dictConfig({"version": 1, "root": {"level": "INFO"}})
    elif case == "fileConfig":
        path = tempfile.mktemp(suffix=".ini")
        with open(path, "w") as f:
            f.write(textwrap.dedent('''
                [loggers]
                keys=root
                [handlers]
                keys=
                [formatters]
                keys=
                [logger_root]
                level=INFO
                handlers=
            '''))
        logging.config.fileConfig(path)
    elif case == "disable":
        logging.disable(logging.INFO)

if order == "config-first":
    configure_logging()
dcp_otel.instrument(tracer_provider=provider, registry=registry)
if order == "instrument-first":
    configure_logging()

import torch.distributed.checkpoint.logger as dcp_logging
torch_logger = dcp_logging._dcp_logger.logger  # torch's own logger, behind dcp-otel's tap
state = {"w": torch.arange(8.0)}
with tempfile.TemporaryDirectory() as tmp:
    dcp.save(state, checkpoint_id=tmp)
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, checkpoint_id=tmp)
dcp_otel.flush()
spans = [s.name for s in exporter.get_finished_spans()]
print(json.dumps({
    "spans": spans,
    "loaded_ok": bool(torch.equal(loaded["w"], state["w"])),
    "saves": registry.get_sample_value("dcp_operations_total", {"operation": "save", "rank": "0", "status": "success"}),
    "loads": registry.get_sample_value("dcp_operations_total", {"operation": "load", "rank": "0", "status": "success"}),
    # the application's configuration still holds: dcp-otel re-enables nothing
    "torch_logger_enabled": torch_logger.isEnabledFor(logging.DEBUG),
}))
"""


def run_case(case: str, order: str, tmp_path: Path) -> dict:
    script = tmp_path / "logging_case.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), case, order], env=rank_env(), cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("case", "order"),
    [("dictConfig", "instrument-first"), ("fileConfig", "config-first"), ("disable", "instrument-first")],
)
def test_a_logging_configuration_that_silences_torchs_logger_loses_no_checkpoint(
    case: str, order: str, tmp_path: Path
) -> None:
    result = run_case(case, order, tmp_path)
    assert result["loaded_ok"]
    assert result["spans"].count("dcp.save") == 1 and result["spans"].count("dcp.load") == 1
    assert "dcp.write_data" in result["spans"] and "dcp.read_data" in result["spans"]
    assert result["saves"] == 1.0 and result["loads"] == 1.0
    assert result["torch_logger_enabled"] is False  # still silenced for the application, as it asked


def _records_of_a_save(torch_logger: logging.Logger, path: Path) -> list[tuple[str, int, str, str, object]]:
    """(file, line, function, message's event, stack info) of each record torch's logger handles in one save."""
    import torch
    import torch.distributed.checkpoint as dcp

    seen: list[tuple[str, int, str, str, object]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.pathname, record.lineno, record.funcName, record.msg["event"], record.stack_info))

    keep, level = Keep(), torch_logger.level
    torch_logger.addHandler(keep)
    torch_logger.setLevel(logging.DEBUG)
    try:
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(path))
    finally:
        torch_logger.removeHandler(keep)
        torch_logger.setLevel(level)
    return seen


def _without_the_tap(path: Path) -> list[tuple[str, int, str, str, object]]:
    """The same save with torch's logger in its own place (dcp-otel's tap stepped aside)."""
    import torch.distributed.checkpoint.logger as dcp_logging

    tap = dcp_logging._dcp_logger
    dcp_logging._dcp_logger = tap.logger
    try:
        return _records_of_a_save(tap.logger, path)
    finally:
        dcp_logging._dcp_logger = tap


def test_torchs_own_log_lines_keep_the_file_and_line_torch_logged_them_from(traced, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The tap passes each record on as torch's logger would have got it: a ``%(filename)s:%(lineno)s``
    format shows torch's ``logger.py`` and the same lines as without dcp-otel, never dcp-otel's tap."""
    import torch.distributed.checkpoint.logger as dcp_logging

    torch_logger = dcp_logging._dcp_logger.logger  # torch's own logger, behind dcp-otel's tap
    with_tap = _records_of_a_save(torch_logger, tmp_path / "a")
    assert traced.spans(), "the save was traced: the tap was in place"
    assert {(Path(file).name, function) for file, _, function, _, _ in with_tap} == {("logger.py", "wrapper")}
    assert with_tap == _without_the_tap(tmp_path / "b")
    # The frame logging skips still says whose it is, in a profile or a traceback.
    assert "dcp_otel" in type(dcp_logging._dcp_logger).debug.__code__.co_name


def test_a_logger_whose_debug_is_its_own_still_has_it_called_with_the_callers_line(traced, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Code that replaced the logger's ``debug`` (a wrapper of its own, a subclass) keeps seeing every record,
    each naming the line it named without dcp-otel; the tap only takes logging's own ``debug`` short."""
    import torch.distributed.checkpoint.logger as dcp_logging

    torch_logger = dcp_logging._dcp_logger.logger
    called: list[str] = []

    def own_debug(msg: object, *args: object, **kwargs: object) -> None:
        called.append(msg["event"])  # type: ignore[index]
        logging.Logger.debug(torch_logger, msg, *args, **kwargs)  # type: ignore[arg-type]

    torch_logger.debug = own_debug  # type: ignore[method-assign]
    try:
        with_tap = _records_of_a_save(torch_logger, tmp_path / "a")
        seen_with_tap = len(called)
        without = _without_the_tap(tmp_path / "b")
    finally:
        del torch_logger.debug
    assert traced.spans(), "the save was traced: the tap was in place"
    assert seen_with_tap == len(with_tap) > 0 and len(called) == seen_with_tap + len(without)
    assert {function for _, _, function, _, _ in with_tap} == {"own_debug"}
    assert with_tap == without


def test_a_stand_in_logger_of_another_kind_gets_every_record_and_the_tap_never_raises() -> None:
    """Whatever stands in torch's logger global (an adapter with slots, no ``__dict__``) is called as torch
    would call it, keywords included; only logging's own ``Logger.debug`` is taken short."""
    from types import SimpleNamespace

    from dcp_otel.attach.logger_tap import DCPLoggerTap

    class Slotted:
        __slots__ = ("seen",)

        def __init__(self) -> None:
            self.seen: list[tuple[object, dict[str, object]]] = []

        def debug(self, msg: object, *args: object, **kwargs: object) -> None:
            self.seen.append((msg, kwargs))

    stand_in, fed = Slotted(), []
    tap = DCPLoggerTap(stand_in, SimpleNamespace(on_record=lambda msg: fed.append(msg) or True, lane=None))  # type: ignore[arg-type]
    tap.debug({"event": "start"})
    tap.debug({"event": "end"}, stacklevel=3)
    assert fed == [{"event": "start"}, {"event": "end"}]
    assert stand_in.seen == [({"event": "start"}, {}), ({"event": "end"}, {"stacklevel": 3})]


def _with_and_without_the_tap(traced, tmp_path: Path, run: Callable[[logging.Logger, Path], Any]) -> tuple[Any, Any]:  # type: ignore[no-untyped-def]
    """``run(torch's logger, a checkpoint path)`` with the tap in place (the save traced), then with torch's own
    logger standing where the tap stood (as without dcp-otel)."""
    import torch.distributed.checkpoint.logger as dcp_logging

    tap = dcp_logging._dcp_logger
    with_tap = run(tap.logger, tmp_path / "a")
    assert traced.spans(), "the save was traced: the tap was in place"
    dcp_logging._dcp_logger = tap.logger
    try:
        without = run(tap.logger, tmp_path / "b")
    finally:
        dcp_logging._dcp_logger = tap
    return with_tap, without


class _Quiet(logging.Logger):
    def debug(self, msg: object, *args: object, **kwargs: object) -> None:
        pass


_QUIET = logging.getLogger("tests.quiet")
_QUIET.setLevel(logging.CRITICAL)

#: What a key's ``state_dict`` does to torch's logger while its conversion runs: each silences it from then on.
_SILENCERS = {
    "its level": lambda logger: logger.setLevel(logging.WARNING),
    "a debug set on it": lambda logger: setattr(logger, "debug", lambda msg, *args, **kwargs: None),  # (a mock's)
    "a mock set as its debug": lambda logger: setattr(logger, "debug", MagicMock()),  # (mock.patch.object's)
    "another logger's debug set on it": lambda logger: setattr(logger, "debug", logging.getLogger("tests.elsewhere").debug),
    "another logger's isEnabledFor set on it": lambda logger: setattr(logger, "isEnabledFor", _QUIET.isEnabledFor),
    "an isEnabledFor set on it": lambda logger: setattr(logger, "isEnabledFor", lambda level: False),
    "its class": lambda logger: setattr(logger, "__class__", _Quiet),
    "Logger's own isEnabledFor": lambda logger: setattr(logging.Logger, "isEnabledFor", lambda self, level: False),
    "Logger's own debug": lambda logger: setattr(logging.Logger, "debug", lambda self, msg, *args, **kwargs: None),
}


class _Silences:
    """A Stateful whose ``state_dict`` silences torch's logger (one of ``_SILENCERS``) while its conversion runs."""

    def __init__(self, torch_logger: logging.Logger, silence: Callable[[logging.Logger], None]) -> None:
        self.torch_logger, self.silence = torch_logger, silence

    def state_dict(self) -> dict:
        import torch

        self.silence(self.torch_logger)
        return {"x": torch.ones(1)}

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - Stateful protocol
        pass


def _keys_logged(torch_logger: logging.Logger, path: Path, silence: Callable[[logging.Logger], None]) -> list[tuple[str, str]]:
    """(function, event) of each record torch's logger handles in a save whose third key silences it."""
    import torch
    import torch.distributed.checkpoint as dcp

    seen: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.msg["func_name"], record.msg["event"]))

    keep, level, enabled, debug = Keep(), torch_logger.level, logging.Logger.isEnabledFor, logging.Logger.debug
    torch_logger.addHandler(keep)
    torch_logger.setLevel(logging.DEBUG)
    try:
        state = {"a": torch.ones(1), "b": torch.ones(1), "quiet": _Silences(torch_logger, silence), "c": torch.ones(1)}
        dcp.save(state, checkpoint_id=str(path))
    finally:
        logging.Logger.isEnabledFor, logging.Logger.debug = enabled, debug  # type: ignore[method-assign]
        torch_logger.__class__ = logging.Logger
        for name in ("debug", "isEnabledFor"):
            torch_logger.__dict__.pop(name, None)
        torch_logger.removeHandler(keep)
        torch_logger.setLevel(level)
    return seen


@pytest.mark.parametrize("silencer", list(_SILENCERS))
def test_a_logger_changed_while_a_state_dict_converts_is_as_without_the_tap_from_the_next_record(traced, tmp_path: Path, silencer: str) -> None:  # type: ignore[no-untyped-def]
    """The tap's per-key reader does what ``Logger.debug`` and ``isEnabledFor`` do in its own frame: it reads the
    level for every record, and at every key's end whether the logger's debug and isEnabledFor are still logging's
    own (else the tap's method reads every record from then on). A key whose conversion silences torch's logger,
    any of these ways, has its own start logged and nothing after it, with the tap as without."""
    with_tap, without = _with_and_without_the_tap(traced, tmp_path, lambda logger, path: _keys_logged(logger, path, _SILENCERS[silencer]))
    assert with_tap == without
    assert with_tap[-1] == ("_stateful_to_state_dict.quiet", "start")
    assert ("_stateful_to_state_dict.b", "end") in with_tap


class _Raises:
    """A Stateful whose ``state_dict`` raises: torch logs its key's, and the save's, exception records."""

    def state_dict(self) -> dict:
        raise RuntimeError("boom")

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - Stateful protocol
        pass


class _ErrorWithoutKeywords(logging.Logger):
    """A logger whose ``error`` takes no keyword arguments (torch passes none)."""

    seen: list[tuple[object, ...]] = []  # noqa: RUF012

    def error(self, msg: object, *args: object) -> None:  # type: ignore[override]
        _ErrorWithoutKeywords.seen.append((msg["func_name"], args))  # type: ignore[index]


def _errors_seen(torch_logger: logging.Logger, path: Path, kind: str) -> tuple[str, list[tuple[object, ...]]]:
    """What a save whose key raises raised, and what torch's logger's ``error`` was handed (``kind``: whose)."""
    import torch.distributed.checkpoint as dcp

    seen: list[tuple[object, ...]] = []
    if kind == "an error without keywords":
        _ErrorWithoutKeywords.seen = seen
        torch_logger.__class__ = _ErrorWithoutKeywords
    else:
        mock = MagicMock()
        torch_logger.error = mock  # type: ignore[method-assign]
    try:
        try:
            dcp.save({"a": _Raises()}, checkpoint_id=str(path))
            raised = "nothing"
        except Exception as exc:  # noqa: BLE001 - what the save raised is what is compared
            raised = f"{type(exc).__name__}: {exc}"
        if kind != "an error without keywords":
            seen = [(c.args[0]["func_name"], c.args[1:], c.kwargs) for c in mock.call_args_list]
    finally:
        torch_logger.__class__ = logging.Logger
        torch_logger.__dict__.pop("error", None)
    return raised, seen


@pytest.mark.parametrize("kind", ["an error without keywords", "a mock as its error"])
def test_torchs_exception_records_reach_its_loggers_own_error_as_without_the_tap(traced, tmp_path: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """The tap's ``error`` passes torch's call on as torch made it (its frame is logging's own, as its ``debug``'s):
    it once added ``stacklevel``, which an ``error`` taking no keywords raised on, in place of the user's error."""
    with_tap, without = _with_and_without_the_tap(traced, tmp_path, lambda logger, path: _errors_seen(logger, path, kind))
    assert with_tap == without
    assert with_tap[0] == "RuntimeError: boom" and with_tap[1], with_tap
