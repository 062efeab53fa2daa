"""``dcp-otel status``: where every rank of a running job's checkpoint is, on one screen.

When a checkpoint hangs, the first questions are which rank, where, since when,
and who waits for it. This asks the ranks themselves (the endpoints their
Prometheus discovery files list) or a Prometheus that scrapes them, and prints,
per run and open operation: the ranks stuck in a step first (with their host),
then the ones waiting between steps, how long each has gone without progress
against its stall threshold, and the stuck thread's stack from the last stall
report (each endpoint serves its reports at ``/dcp-otel/stalls``). Endpoints
that do not answer are listed: a rank that died is an answer too.

Usage::

    dcp-otel status                                   # the endpoints in $DCP_OTEL_FILE_SD_DIR
    dcp-otel status --targets /shared/prometheus/targets --run rdzv-42
    dcp-otel status --prometheus http://prometheus:9090 --run rdzv-42
    dcp-otel status --json | jq '.ranks[] | select(.stalled and (.waiting | not))'   # the stuck ranks, for scripts

Exit status: 0 when no open operation is past its stall threshold, 1 when one
is, 2 when there is nothing to ask (no folder, no Prometheus, no endpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from dcp_otel import semconv
from dcp_otel.live.status import STALLS_PATH

#: Endpoints asked at once (a 1,024-rank job's are asked in a few rounds).
_PARALLEL = 32
#: Rows shown per operation (the worst first), and stacks of stuck ranks.
ROWS, STACKS = 20, 3
#: Lines of each stack shown (its innermost: where the thread is).
STACK_LINES = 12


@dataclass(frozen=True)
class Position:
    """One rank's open operation: where it is, since when, and its stall threshold."""

    job: str
    run: str
    operation: str
    rank: str
    step: str
    since: float  # Unix seconds of its last progress
    threshold_s: float | None
    host: str
    instance: str

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.since)

    def stalled(self, now: float) -> bool:
        return self.threshold_s is not None and self.threshold_s > 0 and self.age_s(now) > self.threshold_s


@dataclass
class Snapshot:
    """What the endpoints (or Prometheus) said."""

    positions: list[Position] = field(default_factory=list)
    #: (instance, rank) -> that endpoint's latest stall report of the rank (operation, step, stack, ...).
    reports: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    unreachable: list[tuple[str, str]] = field(default_factory=list)  # (instance, why)
    asked: int = 0

    def keep(self, instance: str, reports: list[dict[str, Any]]) -> None:
        """The stall reports ``instance`` served, by the rank each is of."""
        for report in reports:
            self.reports.setdefault((instance, str(report.get("rank", ""))), []).append(report)


def _get(url: str, timeout_s: float, accept: str = "text/plain") -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the user's endpoints
        return response.read()  # type: ignore[no-any-return]


def _why(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc) or type(exc).__name__


def parse_metrics(text: str, labels: dict[str, str], instance: str) -> list[Position]:
    """The open operations in one endpoint's Prometheus text, with its target ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    since: dict[tuple[str, str, str], float] = {}
    thresholds: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == semconv.METRIC_IN_PROGRESS and sample.value > 0:  # 0: ended (multiprocess files)
                key = (sample.labels.get("operation", ""), sample.labels.get("step", ""), sample.labels.get("rank", ""))
                since[key] = sample.value
            elif sample.name == semconv.METRIC_STALL_THRESHOLD:
                thresholds[(sample.labels.get("operation", ""), sample.labels.get("rank", ""))] = sample.value
    host = labels.get(semconv.LABEL_HOST) or instance.rsplit(":", 1)[0]
    return [Position(labels.get("job", ""), labels.get(semconv.LABEL_RUN_ID, ""), op, rank, step, value,
                     thresholds.get((op, rank)), host, instance)
            for (op, step, rank), value in since.items()]  # fmt: skip


def _stall_reports(instance: str, timeout_s: float) -> list[dict[str, Any]]:
    """An endpoint's latest stall reports; none where it does not serve them (an older dcp-otel)."""
    try:
        body = json.loads(_get(f"http://{instance}{STALLS_PATH}", timeout_s, "application/json"))
        return [r for r in body.get("stalls", []) if isinstance(r, dict)]
    except (OSError, ValueError, AttributeError):
        return []


def targets_in(folder: Path) -> list[tuple[str, dict[str, str]]]:
    """(instance, target labels) of every rank endpoint announced in ``folder``'s discovery files."""
    found: list[tuple[str, dict[str, str]]] = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            groups = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed or half-written by someone else: the next run sees it
        for group in groups if isinstance(groups, list) else []:
            labels = {str(k): str(v) for k, v in (group.get("labels") or {}).items()}
            found.extend((str(target), labels) for target in group.get("targets", []))
    return found


def from_endpoints(targets: Iterable[tuple[str, dict[str, str]]], timeout_s: float) -> Snapshot:
    """Ask every endpoint for its metrics and stall reports, in parallel."""
    targets = list(targets)
    snapshot = Snapshot(asked=len(targets))

    def ask(target: tuple[str, dict[str, str]]) -> tuple[str, list[Position] | str, list[dict[str, Any]]]:
        instance, labels = target
        try:
            text = _get(f"http://{instance}/metrics", timeout_s).decode("utf-8", "replace")
            positions = parse_metrics(text, labels, instance)
        except (OSError, ValueError) as exc:  # not there, or not Prometheus's text (another service on that port)
            return instance, _why(exc), []
        return instance, positions, _stall_reports(instance, timeout_s) if positions else []

    with ThreadPoolExecutor(max_workers=max(1, min(_PARALLEL, len(targets)))) as pool:
        for instance, answer, reports in pool.map(ask, targets):
            if isinstance(answer, str):
                snapshot.unreachable.append((instance, answer))
                continue
            snapshot.positions.extend(answer)
            snapshot.keep(instance, reports)
    return snapshot


def _prometheus_query(url: str, expr: str, timeout_s: float) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    body = json.loads(_get(f"{url.rstrip('/')}/api/v1/query?{query}", timeout_s, "application/json"))
    if body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body.get('error', body)}")
    return list(body["data"]["result"])


def from_prometheus(url: str, matchers: str, timeout_s: float) -> Snapshot:
    """The open operations Prometheus holds now (``matchers``: label matchers without braces); the stall
    reports from each instance it scrapes, where this machine reaches them."""
    sel = "{" + matchers + "}" if matchers else ""
    since = _prometheus_query(url, f"{semconv.METRIC_IN_PROGRESS}{sel} > 0", timeout_s)
    limits = _prometheus_query(url, f"{semconv.METRIC_STALL_THRESHOLD}{sel}", timeout_s)
    threshold = {(r["metric"].get("instance", ""), r["metric"].get("operation", ""), r["metric"].get("rank", "")):
                 float(r["value"][1]) for r in limits}  # fmt: skip
    snapshot = Snapshot()
    instances = set()
    for r in since:
        m = r["metric"]
        instance = m.get("instance", "")
        instances.add(instance)
        snapshot.positions.append(Position(
            m.get("job", ""), m.get(semconv.LABEL_RUN_ID, ""), m.get("operation", ""), m.get("rank", ""),
            m.get("step", ""), float(r["value"][1]), threshold.get((instance, m.get("operation", ""), m.get("rank", ""))),
            m.get(semconv.LABEL_HOST) or instance.rsplit(":", 1)[0], instance))  # fmt: skip
    snapshot.asked = len(instances)
    asked = sorted(instances)
    with ThreadPoolExecutor(max_workers=max(1, min(_PARALLEL, len(asked)))) as pool:
        for instance, reports in zip(asked, pool.map(lambda i: _stall_reports(i, timeout_s), asked), strict=True):
            snapshot.keep(instance, reports)
    return snapshot


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


#: Where a rank is waiting for the others, not stuck in its own work: between DCP's steps (its collectives), or in a
#: checkpointer's barrier or its wait for the previous write.
_WAITING: Final = semconv.WAITING_STEPS | semconv.WAIT_STEPS


def _order(p: Position, now: float) -> tuple[int, float]:
    """Stuck in a step first, then in a step, then waiting for the others; the longest without progress first."""
    in_step = p.step not in _WAITING
    return (0 if in_step and p.stalled(now) else 1 if in_step else 2, -p.age_s(now))


def render(snapshot: Snapshot, now: float | None = None, rows: int = ROWS) -> str:
    """The screen: one block per run and open operation, the stuck ranks first."""
    now = time.time() if now is None else now
    lines: list[str] = []
    groups: dict[tuple[str, str, str], list[Position]] = {}
    for p in snapshot.positions:
        groups.setdefault((p.job, p.run, p.operation), []).append(p)
    for (job, run, operation), positions in sorted(groups.items()):
        positions.sort(key=lambda p: _order(p, now))
        stalled = [p for p in positions if p.stalled(now)]
        stuck = [p for p in stalled if p.step not in _WAITING]
        waiting = [p for p in positions if p.step in _WAITING]
        how = "between steps" if all(p.step in semconv.WAITING_STEPS for p in waiting) else "for the others"
        state = (f"STALLED: {len(stuck)} rank(s) stuck in a step" if stuck else
                 "STALLED: every rank waits between steps (one never reached DCP's collective)" if stalled else
                 "in progress")  # fmt: skip
        named = f"run {run or '(no dcp_run_id label)'}" + (f" (job {job})" if job else "")
        lines.append(f"{named} {operation}: {len(positions)} rank(s) open, "
                     f"{len(waiting)} waiting {how} - {state}")  # fmt: skip
        lines.append(f"  {'RANK':>6}  {'HOST':<20}  {'STEP':<24}  {'NO PROGRESS FOR':>15}  {'THRESHOLD':>9}  SINCE")
        for p in positions[:rows]:
            limit = _duration(p.threshold_s) if p.threshold_s else "-"
            mark = "  STALLED" if p.stalled(now) else ""
            lines.append(f"  {p.rank:>6}  {p.host[:20]:<20}  {p.step[:24]:<24}  {_duration(p.age_s(now)):>15}  "
                         f"{limit:>9}  {time.strftime('%H:%M:%S', time.localtime(p.since))}{mark}")  # fmt: skip
        if len(positions) > rows:
            rest = positions[rows:]
            lines.append(f"  ... {len(rest)} more rank(s), {sum(p.step in _WAITING for p in rest)} of them "
                         f"waiting {how}")  # fmt: skip
        for p in (stuck or stalled)[:STACKS]:
            report = _latest_report(snapshot, p)
            if report is None:
                continue
            at = time.strftime("%H:%M:%S", time.localtime(float(report.get("reported_at") or 0)))
            waits = f", waiting in {report['collective']}" if report.get("collective") else ""
            lines.append(f"  last stall report of rank {p.rank} on {p.host} ({report.get('step')}, {at}{waits}):")
            stack = str(report.get("stack") or "(no stack: the thread was not found)").rstrip("\n").splitlines()
            if len(stack) > STACK_LINES:
                stack = ["...", *stack[-STACK_LINES:]]
            lines.extend(f"    {line}" for line in stack)
        lines.append("")
    if not groups:
        lines.append(f"no checkpoint in progress ({snapshot.asked - len(snapshot.unreachable)} of {snapshot.asked} "
                     "endpoints answered)")  # fmt: skip
    for instance, why in snapshot.unreachable:
        lines.append(f"unreachable: {instance} ({why}): a rank that died or whose process is frozen")
    return "\n".join(lines).rstrip("\n") + "\n"


def _latest_report(snapshot: Snapshot, p: Position) -> dict[str, Any] | None:
    """The rank's newest report of this operation and step, made during this stall (not an older one)."""
    reports = [r for r in snapshot.reports.get((p.instance, p.rank), [])
               if r.get("operation") == p.operation and r.get("step") == p.step
               and float(r.get("reported_at") or 0) >= p.since]  # fmt: skip
    return max(reports, key=lambda r: float(r.get("reported_at") or 0), default=None)


def as_json(snapshot: Snapshot, now: float) -> dict[str, Any]:
    """What :func:`render` prints, for scripts: every open operation of every rank (stuck ones first, with their
    newest stall report), and the endpoints that did not answer."""
    ranks = []
    for p in sorted(snapshot.positions, key=lambda p: (p.job, p.run, p.operation, _order(p, now))):
        report = _latest_report(snapshot, p)
        ranks.append({"job": p.job, "run": p.run, "operation": p.operation, "rank": p.rank, "host": p.host,
                      "instance": p.instance, "step": p.step, "waiting": p.step in _WAITING,
                      "since": p.since, "seconds_without_progress": round(p.age_s(now), 3),
                      "threshold_seconds": p.threshold_s, "stalled": p.stalled(now), "stall_report": report})  # fmt: skip
    return {"time": now, "asked": snapshot.asked, "ranks": ranks,
            "unreachable": [{"instance": i, "error": why} for i, why in snapshot.unreachable]}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", type=Path, default=None,
                        help=f"the folder of the ranks' discovery files (default ${semconv.ENV_FILE_SD_DIR})")
    parser.add_argument("--prometheus", metavar="URL", help="ask this Prometheus instead of the endpoints")
    parser.add_argument("--run", help="only this run id (dcp_run_id)")
    parser.add_argument("--job", help="only this job")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each endpoint (default 5)")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"ranks shown per operation (default {ROWS})")
    parser.add_argument("--json", action="store_true", help="print every rank's position as JSON, for scripts")


def run(args: argparse.Namespace) -> int:
    """The command; raises ``ValueError`` for what the user has to fix."""
    if args.timeout <= 0 or args.rows < 1:
        raise ValueError("--timeout must be above 0 and --rows at least 1")
    if args.prometheus:
        matchers = ",".join(f'{label}="{value}"' for label, value in
                            ((semconv.LABEL_RUN_ID, args.run), ("job", args.job)) if value)  # fmt: skip
        try:
            snapshot = from_prometheus(args.prometheus, matchers, args.timeout)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot query {args.prometheus}: {_why(exc)}") from exc
    else:
        folder = args.targets or (Path(os.environ[semconv.ENV_FILE_SD_DIR])
                                  if os.environ.get(semconv.ENV_FILE_SD_DIR, "").strip() else None)  # fmt: skip
        if folder is None:
            raise ValueError(f"say where the ranks are: --targets FOLDER (or ${semconv.ENV_FILE_SD_DIR}), "
                             "or --prometheus URL")  # fmt: skip
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder of discovery files")
        targets = [(instance, labels) for instance, labels in targets_in(folder)
                   if (not args.run or labels.get(semconv.LABEL_RUN_ID) == args.run)
                   and (not args.job or labels.get("job") == args.job)]  # fmt: skip
        if not targets:
            raise ValueError(f"no rank endpoint announced in {folder}" + (" for that run or job" if args.run or args.job else ""))
        snapshot = from_endpoints(targets, args.timeout)
    now = time.time()
    print(json.dumps(as_json(snapshot, now), indent=1) if args.json else render(snapshot, now, args.rows), end="\n" if args.json else "")
    return 1 if any(p.stalled(now) for p in snapshot.positions) else 0
