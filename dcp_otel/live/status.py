"""The last stall reports of this process, served as JSON beside its metrics, for ``dcp-otel status``.

Prometheus can say which rank is in which step since when, but not where its
thread is stuck. Each stall report (:mod:`dcp_otel.live.stalls`) is kept here,
the latest per operation and step, and a rank's metrics endpoint answers
``GET /dcp-otel/stalls`` with them: the stuck thread's stack, the collective it
waits in, when. Reading the board never waits for the watchdog (one lock held
only to copy a small dict) and is not a scrape (it never ends a wait for one).

Usage::

    board().record(operation="save", step="write_data", rank="3", seconds=312.0, threshold_s=300.0,
                   stack="File ...", collective=None)
    board().snapshot()     # {"pid": ..., "host": ..., "stalls": [{...}]}
    # curl http://<rank>:9710/dcp-otel/stalls
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from dcp_otel import _forksafe

#: The path ``dcp-otel status`` asks each endpoint for.
STALLS_PATH: Final = "/dcp-otel/stalls"
#: Reports kept (one per operation and step; bounded by DCP's step names, and this in any case).
_KEPT: Final = 32


class StallBoard:
    """The latest stall report of each (operation, step, rank) of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[tuple[str, str, str], dict[str, Any]] = {}
        _forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        """A forked child: its own board (the parent's lock may have been held; its reports are the parent's)."""
        self._lock = threading.Lock()
        self._reports = {}

    def record(self, *, operation: str, step: str, rank: str, seconds: float, threshold_s: float,
               stack: str | None, collective: str | None, where: str | None = None) -> None:  # fmt: skip
        report = {"operation": operation, "step": step, "rank": rank, "seconds_without_progress": round(seconds, 3),
                  "threshold_seconds": threshold_s, "reported_at": time.time(), "stack": stack,
                  "collective": collective, "where": where}  # fmt: skip
        with self._lock:
            self._reports.pop((operation, step, rank), None)  # re-inserted last: the newest
            self._reports[(operation, step, rank)] = report
            while len(self._reports) > _KEPT:
                self._reports.pop(next(iter(self._reports)))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            stalls = list(self._reports.values())
        return {"pid": os.getpid(), "host": socket.gethostname(), "stalls": stalls}

    def clear(self) -> None:
        with self._lock:
            self._reports.clear()


_BOARD = StallBoard()


def board() -> StallBoard:
    """This process's board."""
    return _BOARD


def serving(app: Callable[..., Any]) -> Callable[..., Any]:
    """``app`` (an endpoint's WSGI app), answering :data:`STALLS_PATH` itself."""

    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != STALLS_PATH:
            return app(environ, start_response)  # type: ignore[no-any-return]
        body = json.dumps(_BOARD.snapshot()).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return routed
