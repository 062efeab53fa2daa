"""The signal wakeup fd is dcp-otel's only while nobody else holds it (see dcp_otel/live/wakeup.py)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel.live.wakeup import _REAL_SET_WAKEUP_FD


@pytest.fixture
def theirs() -> Iterator[socket.socket]:
    """Another library's wakeup socket (asyncio's or trio's kind: non-blocking)."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    yield writer
    reader.close()
    writer.close()


@pytest.fixture
def instrumented(provider: tuple) -> Iterator[dcp_otel.DCPInstrumentor]:
    dcp_otel.instrument(tracer_provider=provider[0], registry=CollectorRegistry())
    try:
        yield dcp_otel.DCPInstrumentor()
    finally:
        dcp_otel.uninstrument()


def test_another_setter_gets_the_fd_as_if_nobody_held_it_and_dcp_otel_takes_it_back_when_given_back(
    instrumented: dcp_otel.DCPInstrumentor, theirs: socket.socket
) -> None:
    guard = instrumented.signals
    assert guard is not None and guard.wakeup_owned and guard.installed == [signal.SIGTERM]
    # An event loop takes it: for the caller nobody held it (trio warns otherwise), and SIGTERM is left to
    # SIG_DFL, since nobody would hear it while the main thread is blocked in C.
    assert signal.set_wakeup_fd(theirs.fileno(), warn_on_full_buffer=False) == -1
    assert not guard.wakeup_owned and guard.installed == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # It gives it back (asyncio's loop closing): the caller gets its own fd back, dcp-otel takes both again.
    assert signal.set_wakeup_fd(-1) == theirs.fileno()
    assert guard.wakeup_owned and guard.installed == [signal.SIGTERM]
    assert signal.set_wakeup_fd(-1) == -1  # (and again: still nobody's, for the caller)


def test_a_fd_held_before_instrument_stays_its_holders_until_given_back(provider: tuple, theirs: socket.socket) -> None:
    _REAL_SET_WAKEUP_FD(theirs.fileno())
    try:
        dcp_otel.instrument(tracer_provider=provider[0], registry=CollectorRegistry())
        guard = dcp_otel.DCPInstrumentor().signals
        assert guard is not None and not guard.wakeup_owned and guard.installed == []
        assert _REAL_SET_WAKEUP_FD(theirs.fileno()) == theirs.fileno()  # untouched
        assert signal.set_wakeup_fd(-1) == theirs.fileno()  # given back through the stand-in: ours now
        assert guard.wakeup_owned and guard.installed == [signal.SIGTERM]
    finally:
        dcp_otel.uninstrument()
        _REAL_SET_WAKEUP_FD(-1)


def test_uninstrument_puts_back_the_interpreters_set_wakeup_fd_unless_someone_wrapped_it(provider: tuple) -> None:
    before = signal.set_wakeup_fd
    dcp_otel.instrument(tracer_provider=provider[0], registry=CollectorRegistry())
    assert signal.set_wakeup_fd is not before
    dcp_otel.uninstrument()
    assert signal.set_wakeup_fd is before and _REAL_SET_WAKEUP_FD(-1) == -1

    dcp_otel.instrument(tracer_provider=provider[0], registry=CollectorRegistry())
    ours = signal.set_wakeup_fd

    def their_wrapper(fd: int, /, *, warn_on_full_buffer: bool = True) -> int:
        return ours(fd, warn_on_full_buffer=warn_on_full_buffer)

    signal.set_wakeup_fd = their_wrapper
    try:
        dcp_otel.uninstrument()
        assert signal.set_wakeup_fd is their_wrapper  # theirs stays; ours under it only passes calls through
        assert _REAL_SET_WAKEUP_FD(-1) == -1
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        assert signal.set_wakeup_fd(writer.fileno()) == -1 and signal.set_wakeup_fd(-1) == writer.fileno()
        assert _REAL_SET_WAKEUP_FD(-1) == -1  # passed through: nobody took it back
        reader.close()
        writer.close()
    finally:
        signal.set_wakeup_fd = before
