"""``dcp-otel-run``: ``torchrun`` with the torchelastic agent observable.

torchelastic's agent (rendezvous, worker start, restarts, run results) emits
its metrics in the launcher process, not in the workers. This drop-in for
``torchrun`` configures :class:`~dcp_otel.OTelMetricHandler` for every metric
group and serves the agent's metrics on their own endpoint, then runs torchrun
unchanged with the same arguments. Its workers also get dcp-otel's resource
detector (host, rank, run id; see :mod:`dcp_otel.resource`).

Usage::

    dcp-otel-run --nproc-per-node 8 train.py          # instead of: torchrun --nproc-per-node 8 train.py
    python -m dcp_otel.elastic.launcher --standalone --nproc-per-node 2 train.py

The agent serves on ``$DCP_OTEL_AGENT_METRICS_PORT`` (default 9709; the ranks
use ``$DCP_OTEL_METRICS_PORT`` + ``LOCAL_RANK``, default 9710 + ``LOCAL_RANK``)
at ``$DCP_OTEL_METRICS_ADDR`` (default all interfaces), announced in
``$DCP_OTEL_FILE_SD_DIR`` when set. The run results are recorded when the
workers are done: with ``$DCP_OTEL_FINAL_SCRAPE_TIMEOUT_S`` the agent waits for
one last scrape before it exits, so they reach Prometheus. Agent phases become
spans when an OpenTelemetry SDK is configured in the launcher, e.g.
``opentelemetry-instrument dcp-otel-run ...``.

The agent outlives its workers: a worker that dies with a checkpoint open (the
OOM killer's SIGKILL, NCCL's abort, a segfault, SIGTERM) is reported from the
record it left in the spool, with its exit status, to the OTLP endpoint of the
``OTEL_*`` variables (:func:`report_dead_workers`).

Each round of workers (a restart, or a new rendezvous round after a membership
change, which torchelastic does not count as a restart) gets its own
``$DCP_OTEL_GENERATION``, agreed by the agents of the round through the round's
own rendezvous store, so the traces of two rounds never share ids (see
:func:`dcp_otel.tracing.trace_ids.round_generation`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import wrapt
from torch.distributed.elastic.metrics.api import configure as configure_elastic_metrics

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.cli.check import warn_if_workers_setup_fails
from dcp_otel.config import env_int
from dcp_otel.elastic.handler import OTelMetricHandler
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.exposition import MetricsEndpoint, start_metrics_server
from dcp_otel.tracing.trace_ids import agree_on_generation, resolve_run_id

_DETECTORS_ENV = "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"


def agent_metrics_port() -> int:
    """``$DCP_OTEL_AGENT_METRICS_PORT``, else 9709 (a bad value warns and uses 9709)."""
    port = env_int(semconv.ENV_AGENT_METRICS_PORT, 0, 65535)
    return port if port is not None else semconv.DEFAULT_AGENT_METRICS_PORT


def observe_agent() -> MetricsEndpoint | None:
    """Route every torchelastic metric group to OTelMetricHandler and serve them.

    In Prometheus multiprocess mode the agent records into the shared folder
    like the ranks, and its endpoint serves the whole node's files.
    """
    configure_elastic_metrics(OTelMetricHandler())
    endpoint = start_metrics_server(agent_metrics_port(), per_rank=False, role="agent")
    if endpoint is not None:
        print(f"dcp-otel-run: torchelastic agent metrics at {endpoint.url}", file=sys.stderr, flush=True)
    return endpoint


def enable_resource_detector() -> None:
    """Let the workers' OpenTelemetry SDK say which host, rank and run they are.

    Adds dcp-otel's detector to ``$OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``, which
    every worker inherits (see :mod:`dcp_otel.resource`); detectors already
    listed stay, in their order.
    """
    names = [n.strip() for n in os.environ.get(_DETECTORS_ENV, "").split(",") if n.strip()]
    if semconv.RESOURCE_DETECTOR not in names:
        os.environ[_DETECTORS_ENV] = ",".join([*names, semconv.RESOURCE_DETECTOR])


def publish_generation(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Around the agent's ``_start_workers``: give this round's workers their generation.

    The worker group's store is the rendezvous round's (torch prefixes it with
    the round number), so every agent of the round gets the value the first one
    stored, and the next round starts from an empty key.
    """
    group: Any = args[0] if args else kwargs.get("worker_group")
    try:
        os.environ[semconv.ENV_GENERATION] = agree_on_generation(group.store, semconv.STORE_GENERATION_KEY)
    except Exception as exc:  # noqa: BLE001 - the workers then agree through their own store
        reraise_if_signalled(exc)
        os.environ.pop(semconv.ENV_GENERATION, None)
        report("no_generation", "dcp-otel-run could not agree on a generation for this round of workers",
               exc_info=True)  # fmt: skip
    return wrapped(*args, **kwargs)


def workers_run_id(rdzv_id: str, master_addr: str, master_port: int | None) -> str:
    """The run id the workers will resolve (``dcp.run_id``), seen from the agent before it starts them.

    torchrun gives its workers ``TORCHELASTIC_RUN_ID`` = the rendezvous id (a random one with
    ``--standalone``), and ``MASTER_ADDR``/``MASTER_PORT`` from its options.
    """
    explicit = os.environ.get(semconv.ENV_RUN_ID, "").strip() or None
    if explicit is None and rdzv_id.strip().lower() not in ("", "none"):
        explicit = rdzv_id
    identity = resolve_run_id(explicit, world_size=2)  # any world > 1: a multi-rank job's rules
    return identity.run_id if identity.source != "fallback" else f"{master_addr}:{master_port}"


def label_with_the_run(endpoint: MetricsEndpoint) -> Callable[..., Any]:
    """Around torchrun's ``config_from_args``: once the rendezvous id is final (``--standalone`` draws it
    there), say the workers' run id in the agent's discovery file, as the ranks say it in theirs."""

    def relabel(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            options = args[0] if args else kwargs["args"]
            endpoint.relabel(workers_run_id(str(options.rdzv_id), str(options.master_addr), options.master_port))
        except Exception as exc:  # noqa: BLE001 - the label is ours; the launch is not
            reraise_if_signalled(exc)
            report("file_sd_error", "dcp-otel-run could not label the agent's target with the run id", exc_info=True)
        return result

    return relabel


def report_dead_workers() -> Callable[[], None] | None:
    """Be the survivor of this agent's workers (:mod:`dcp_otel.spool`): a worker that dies with a checkpoint open
    (SIGKILL, a segfault, SIGTERM) is reported from its record, saying how it died, to the global tracer provider
    or the OTLP endpoint of ``OTEL_*`` (``opentelemetry-instrument dcp-otel-run``: the same watch, started by its
    instrumentor). Returns what waits until the deaths seen are sent."""
    from dcp_otel.spool.process import AgentWatch

    watch = AgentWatch.start()
    return watch.settle if watch is not None else None


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default: this process's arguments)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.run import parse_args, run

    # torchrun's own arguments first: --help, --version or a bad option ends here, before any server starts.
    args = parse_args(argv)  # type: ignore[no-untyped-call]
    warn_if_workers_setup_fails("dcp-otel-run")  # their set-up failing loads no dcp-otel to say so
    wrapt.wrap_function_wrapper(local_elastic_agent, "LocalElasticAgent._start_workers", publish_generation)
    enable_resource_detector()
    endpoint = observe_agent()
    settle = report_dead_workers()
    if endpoint is not None:
        from torch.distributed import run as torchrun

        wrapt.wrap_function_wrapper(torchrun, "config_from_args", label_with_the_run(endpoint))
    try:
        run(args)  # type: ignore[no-untyped-call]
    finally:
        if settle is not None:
            settle()  # the workers that died are reported before the agent goes
        if endpoint is not None:
            endpoint.finish()  # the run results are recorded last: let Prometheus take them


if __name__ == "__main__":
    main()
