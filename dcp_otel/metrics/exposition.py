"""Serve the checkpoint metrics to Prometheus: one endpoint per rank.

Eight ranks on a node must not collide, so each rank serves on
``base port + LOCAL_RANK``. A port that is already taken never breaks
training: the rank warns (counted in :func:`dcp_otel.diagnostics` as
``metrics_port_in_use``) and serves on a port the OS picks instead; the
endpoint returned (and the warning) says which.

Prometheus multiprocess mode (one endpoint per node) is used when
``$PROMETHEUS_MULTIPROC_DIR`` is set, as ``prometheus_client`` requires, before
it is imported: every rank records into that folder's files, local rank 0
serves them all on the base port (other ranks get ``None``), and each rank
marks itself dead at exit so the live gauge stays right. A process killed
(SIGKILL, SIGTERM, OOM) runs no exit handler: every scrape of the node's
endpoint first marks dead the processes whose live-gauge files remain and that
no longer exist (:class:`DeadProcessReaper`), so ``dcp_async_saves_in_flight``
of a rank killed mid-upload returns to 0 instead of staying at 1 forever (and
``DCPAsyncSaveStuck`` firing forever). Its limits are
prometheus_client's: no exemplars, and gauges combine across processes as each
metric declares (``dcp_async_saves_in_flight`` sums the live ones,
``dcp_last_success_timestamp_seconds`` takes the max).

Usage::

    endpoint = dcp_otel.start_metrics_server()             # $DCP_OTEL_METRICS_PORT or 9710, + LOCAL_RANK
    endpoint = dcp_otel.start_metrics_server(port=9000, addr="127.0.0.1")
    print(endpoint.url)                                     # http://127.0.0.1:9001/metrics on local rank 1
    endpoint.close()
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.config import env_int
from dcp_otel.live.status import serving as stall_reports
from dcp_otel.metrics.file_sd import Role, TargetFile, announce, configured_dir, target_labels

logger = logging.getLogger("dcp_otel")


class ScrapeWatch:
    """A collector that yields nothing and counts scrapes, so a process can wait for one.

    It counts the endpoint's scrapes as they begin (:meth:`serving` wraps its
    app), and any other reader of that registry (say, a push to a gateway) as
    it collects. Counted when collected, a scrape that began before a wait
    started could end it with values read before the ones waited for (this
    collector is registered after the metrics, so it is collected last): a
    torchelastic agent's run results were then lost now and then. A wait is
    over only once no response is still being written, or a process exiting
    right after the collection would cut its last scrape short (Prometheus
    then gets nothing). Nor does a response written after the deadline its
    scraper sent with it (``X-Prometheus-Scrape-Timeout-Seconds``) end a wait:
    Prometheus has given up on that scrape and stored none of it, so the wait
    goes on for the next one (counted as ``late_scrape``).
    """

    def __init__(self) -> None:
        self._scraped = threading.Condition()
        self._count = 0  # scrapes begun: each is numbered as it begins
        self._answered = 0  # the highest number of a scrape answered in time
        self._responding = 0  # responses being computed or written

    def serving(self, app: Callable[..., Any]) -> Callable[..., Any]:
        """``app`` (the endpoint's WSGI app), each response counted until the server has written it."""

        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            began = time.monotonic()
            with self._scraped:
                # Counted as it begins: a scrape that began before a wait's ``seen`` may have collected the
                # other metrics before the values the wait is for (this collector is registered last, so it
                # is collected last), and must not end the wait.
                self._count += 1
                self._responding += 1
                number = self._count
            deadline = began + _scrape_timeout(environ)

            def written() -> None:
                in_time = time.monotonic() <= deadline
                self._written(number if in_time else None)
                if not in_time:
                    report("late_scrape", "dcp_otel: a scrape was answered after its scraper's timeout; waiting on")

            try:
                return _Written(app(environ, start_response), written)
            except BaseException:
                self._written(None)
                raise

        return counted

    def _written(self, number: int | None) -> None:
        """A response is over: scrape ``number`` answered, or ``None`` when its scraper will not have it."""
        with self._scraped:
            self._responding -= 1
            if number is not None:
                self._answered = max(self._answered, number)
            self._scraped.notify_all()

    def describe(self) -> list[object]:
        return []  # registering must not count as a scrape

    def collect(self) -> list[object]:
        with self._scraped:
            if not self._responding:  # another reader of the registry (a scrape was counted as it began)
                self._count += 1
                self._answered = self._count
                self._scraped.notify_all()
        return []

    def count(self) -> int:
        """Scrapes so far."""
        with self._scraped:
            return self._count

    def wait_past(self, seen: int, timeout_s: float) -> bool:
        """Wait until a scrape after the first ``seen`` was answered in time, and none is being answered;
        ``False`` after ``timeout_s``."""
        with self._scraped:
            return self._scraped.wait_for(lambda: self._answered > seen and not self._responding, timeout=timeout_s)


#: Sent by Prometheus with every scrape: how long it waits for the response.
_TIMEOUT_HEADER = "HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS"


def _scrape_timeout(environ: dict[str, Any]) -> float:
    """The scraper's own deadline for this response, in seconds; unbounded when it sent none (or a bad one)."""
    try:
        timeout = float(environ.get(_TIMEOUT_HEADER) or "inf")
    except ValueError:
        return math.inf
    return timeout if timeout > 0 else math.inf


class _Written:
    """A WSGI response whose ``close`` (called by the server once it has sent the body) calls ``done``."""

    def __init__(self, body: Iterable[bytes], done: Callable[[], None]) -> None:
        self._body, self._done = body, done

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._body)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._done()


@dataclass
class MetricsEndpoint:
    """A running metrics endpoint of this rank."""

    addr: str
    port: int
    requested_port: int
    _server: object = field(repr=False, default=None)
    _thread: threading.Thread | None = field(repr=False, default=None)
    #: This endpoint's Prometheus file_sd target file, when discovery files are on.
    target_file: TargetFile | None = field(repr=False, default=None)
    #: How long :meth:`finish` waits for a last scrape (``$DCP_OTEL_FINAL_SCRAPE_TIMEOUT_S``).
    final_scrape_timeout_s: float = 0.0
    _watch: ScrapeWatch = field(repr=False, default_factory=ScrapeWatch)
    _registry: CollectorRegistry | None = field(repr=False, default=None)
    _pid: int = field(repr=False, default_factory=os.getpid)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    @property
    def fell_back(self) -> bool:
        """True when the requested port was taken and the OS picked this one."""
        return self.port != self.requested_port

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Wait until Prometheus scrapes this endpoint again; ``False`` after ``timeout_s``."""
        return self._server is not None and self._watch.wait_past(self._watch.count(), timeout_s)

    def finish(self) -> None:
        """Let Prometheus take what happened last, then close.

        The last checkpoint of a job (and a torchelastic agent's run results)
        happen just before exit, after the last scrape. With
        ``final_scrape_timeout_s`` set, this waits for one more scrape, at
        most that long, before closing: one answered in full, within the
        timeout its scraper sent. It runs at exit (also in the launcher,
        after its workers ended); not in forked children.
        """
        if os.getpid() != self._pid:
            return
        timeout_s = self.final_scrape_timeout_s if self._server is not None else 0.0
        if timeout_s > 0:
            seen = self._watch.count()  # before the log line: a scrape it prompts still counts
            logger.info("dcp_otel: waiting up to %gs for a last scrape of %s", timeout_s, self.url)
            if not self._watch.wait_past(seen, timeout_s):
                report("final_scrape_timeout", "dcp_otel: no scrape of %s within %gs before exit; its last values are lost",
                       self.url, timeout_s)  # fmt: skip
        self.close()

    def relabel(self, run_id: str) -> None:
        """Say another run id in the discovery file (a launcher learns its run's id after it started serving)."""
        if self.target_file is None:
            return
        try:
            self.target_file.write(target_labels(run_id))
        except OSError as exc:
            report("file_sd_error", "dcp_otel: cannot rewrite the discovery file %s (%s)", self.target_file.path, exc)

    def close(self) -> None:
        """Stop serving, free the port and withdraw the discovery file."""
        atexit.unregister(self.finish)
        if self._registry is not None:
            try:
                self._registry.unregister(self._watch)  # type: ignore[arg-type]
            except KeyError:
                pass
            self._registry = None
        if self.target_file is not None:
            self.target_file.remove()
            self.target_file = None
        server = self._server
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None


def metrics_port(port: int | None = None, per_rank: bool = True) -> int:
    """The port this rank serves on: ``port`` (else ``$DCP_OTEL_METRICS_PORT``, else
    9710), plus ``$LOCAL_RANK`` when ``per_rank``.

    A bad ``$DCP_OTEL_METRICS_PORT`` warns and uses the default.

    Raises:
        ValueError: a port argument, or it plus ``$LOCAL_RANK``, outside 0..65535.
    """
    if port is None:
        from_env = env_int(semconv.ENV_METRICS_PORT, 0, 65535)
        port = from_env if from_env is not None else semconv.DEFAULT_METRICS_PORT
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer from 0 to 65535, got {port!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if per_rank and port else 0
    if not 0 <= port + local_rank <= 65535:
        raise ValueError(f"metrics port {port} + LOCAL_RANK {local_rank} is not a valid port")
    return port + local_rank


def multiprocess_dir() -> str | None:
    """The folder of Prometheus multiprocess mode, if it is on (prometheus_client's variables)."""
    # The lowercase name is prometheus_client's legacy spelling, which it still reads.
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir") or None  # noqa: SIM112


_marked_pids: set[int] = set()


def _mark_dead_at_exit(path: str) -> None:
    """Once per process: at exit, drop this process's live-gauge files."""
    pid = os.getpid()
    if pid not in _marked_pids:
        _marked_pids.add(pid)
        atexit.register(multiprocess.mark_process_dead, pid, path)


_LIVE_FILE = re.compile(r"^gauge_live(?:sum|all|max|min|mostrecent)?_(\d+)\.db$")


def _process_exists(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, killed but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True  # no /proc: os.kill said it exists


class DeadProcessReaper:
    """A collector that yields nothing: on each collection, marks dead the processes that died without saying so.

    Registered before the node's ``MultiProcessCollector``, so a scrape never
    counts the live gauge of a process that no longer exists. Uses
    ``prometheus_client.multiprocess.mark_process_dead``, as the exit handler does.
    """

    def __init__(self, path: str) -> None:
        self._path = path

    def describe(self) -> list[object]:
        return []

    def collect(self) -> list[object]:
        try:
            names = os.listdir(self._path)
        except OSError:
            return []
        pids = {int(m.group(1)) for m in map(_LIVE_FILE.match, names) if m}
        for pid in pids - {os.getpid()}:
            if not _process_exists(pid):
                try:
                    multiprocess.mark_process_dead(pid, self._path)  # type: ignore[no-untyped-call]
                except OSError:  # another scrape removed them first
                    pass
        return []


class OpenOnly:
    """The node's files as ``MultiProcessCollector`` reads them, less the in-progress series of calls that ended.

    prometheus_client cannot remove a series from the shared files, so a rank
    sets a finished operation's in-progress gauges to 0
    (:meth:`dcp_otel.metrics.prometheus.CheckpointMetrics.publish_progress`); here they are
    left out, so a series is there exactly while its call is open, as when a
    rank is scraped on its own.
    """

    _LIVE = frozenset(spec.prometheus for spec in semconv.LIVE_METRICS)

    def __init__(self, collector: Any) -> None:
        self._collector = collector

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[Any]:
        for family in self._collector.collect():
            if family.name in self._LIVE:
                family.samples = [sample for sample in family.samples if sample.value != 0]
            yield family


def start_metrics_server(
    port: int | None = None,
    addr: str | None = None,
    *,
    registry: CollectorRegistry | None = None,
    per_rank: bool = True,
    file_sd_dir: str | os.PathLike[str] | None = None,
    role: Role = "rank",
    run_id: str | None = None,
) -> MetricsEndpoint | None:
    """Serve ``registry`` (default: the global one) for Prometheus to scrape.

    Args:
        port: base port; default ``$DCP_OTEL_METRICS_PORT``, else 9710. Each
            rank adds its ``LOCAL_RANK`` unless ``per_rank=False``. ``0`` lets
            the OS pick.
        addr: bind address; default ``$DCP_OTEL_METRICS_ADDR``, else
            ``0.0.0.0`` (all interfaces: Prometheus scrapes from elsewhere).
            Use ``127.0.0.1`` to serve this host only.

    A port already in use does not raise: the rank warns, counts it, and
    serves on an OS-picked port (see :attr:`MetricsEndpoint.fell_back`).

    In multiprocess mode (``$PROMETHEUS_MULTIPROC_DIR`` set) local rank 0
    serves every process's metrics from that folder on the base port, and
    every other rank returns ``None``; ``registry`` is not used then.

    With ``file_sd_dir`` (default ``$DCP_OTEL_FILE_SD_DIR``) the endpoint
    writes its Prometheus file_sd target file there as ``<role>-<host>-<port>.json``
    (see :mod:`dcp_otel.metrics.file_sd`), labelled with the run (``run_id``, else as the ranks resolve it
    from the environment), host and job. With ``$DCP_OTEL_FINAL_SCRAPE_TIMEOUT_S``
    the process waits at exit (that long at most) for one last scrape, so the
    final checkpoint's metrics reach Prometheus (see :meth:`MetricsEndpoint.finish`).
    """
    bind = addr or os.environ.get(semconv.ENV_METRICS_ADDR, "").strip() or semconv.DEFAULT_METRICS_ADDR
    shared = multiprocess_dir()
    if shared:
        _mark_dead_at_exit(shared)
        if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
            return None  # local rank 0 serves this node
        target = CollectorRegistry()
        target.register(DeadProcessReaper(shared))  # type: ignore[arg-type]  # first: before the files are read
        # (MultiProcessCollector raises if the folder is missing)
        target.register(OpenOnly(multiprocess.MultiProcessCollector(None, path=shared)))  # type: ignore[no-untyped-call]
        wanted = metrics_port(port, per_rank=False)
    else:
        target = registry if registry is not None else REGISTRY
        wanted = metrics_port(port, per_rank)
    try:
        server, thread = start_http_server(wanted, bind, target)
    except OSError as exc:
        report("metrics_port_in_use", "dcp_otel: cannot serve metrics on %s:%d (%s); serving on a free port instead",
               bind, wanted, exc)  # fmt: skip
        server, thread = start_http_server(0, bind, target)
    endpoint = MetricsEndpoint(bind, int(server.server_address[1]), wanted, server, thread)
    app = server.get_app()
    if app is not None:
        # The last stall reports beside the metrics (dcp-otel status reads them); not counted as a scrape.
        server.set_app(stall_reports(endpoint._watch.serving(app)))
    target.register(endpoint._watch)  # type: ignore[arg-type]
    endpoint._registry = target
    endpoint.target_file = announce(configured_dir(file_sd_dir), role, bind, endpoint.port, run_id)
    final_scrape = env_int(semconv.ENV_FINAL_SCRAPE_TIMEOUT_S, 0, 3600)
    if final_scrape:
        endpoint.final_scrape_timeout_s = float(final_scrape)
        atexit.register(endpoint.finish)  # after the discovery file's hook: runs before it
    if endpoint.fell_back:
        logger.warning("dcp_otel: metrics of this rank are at %s", endpoint.url)
    return endpoint
