"""The report for a terminal: the run's summary, then one block per checkpoint operation, worst first.

Usage::

    print(render(checkpoints(spans)))                  # summary, then the 10 worst checkpoints' details
    print(render(checkpoints(spans), limit=None))      # ... every checkpoint's
    print(render_summary(summarize(checkpoints(spans))))
"""

from __future__ import annotations

import datetime
import statistics
import sysconfig
import textwrap

from dcp_otel import semconv
from dcp_otel.report.life import Generation, Life
from dcp_otel.report.model import WRAPPER, Checkpoint, RankResult
from dcp_otel.report.summary import DETAIL_LIMIT, FAILURES_SHOWN, Summary, sparkline, summarize, worst_first
from dcp_otel.tracing.failures import rank_ranges

#: A save or load: total = busy + waiting.
_COLUMNS = ("rank", "total", "busy", "waiting", "bytes", "I/O MB/s", "error")
#: An async save, its two sides apart: the caller's (returned = busy + waiting, staging part of busy)
#: and the upload's (write part of upload busy, part of upload).
_ASYNC_COLUMNS = ("rank", "returned", "busy", "waiting", "staging", "upload", "upload busy", "write", "bytes",
                  "I/O MB/s", "error")  # fmt: skip
#: The error column is cut at a word; the whole error is on the "failed on rank" line.
_ERROR_WIDTH = 60
#: Lines of each failure's cause in the summary.
_CAUSE_LINES = 12
#: A checkpoint's table lists every rank up to this many; beyond, the ranks worth reading.
_RANKS_SHOWN = 16
_SLOWEST_SHOWN = 5
#: Stuck ranks whose stack the summary shows, and how many frames of each.
_STACKS_SHOWN = 2
_FRAMES_SHOWN = 4
_STDLIB = sysconfig.get_paths()["stdlib"] + "/"


def format_bytes(n: int) -> str:
    """``format_bytes(1_572_864) == "1.5 MiB"``: sizes in powers of 1024, named so; rates stay MB/s (10^6 B/s)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render_one(ckpt: Checkpoint) -> str:
    status = "UNFINISHED" if ckpt.is_unfinished else "FAILED" if ckpt.error else "ok"
    lines = [f"{ckpt.title}  {ckpt.duration_s:.3f} s  {status}  started {wall_clock(ckpt.start_ns)}  "
             f"trace {ckpt.trace_id}"]  # fmt: skip
    is_async = ckpt.operation in semconv.ASYNC_OPERATIONS
    rows: list[tuple[str, ...]] = [_ASYNC_COLUMNS if is_async else _COLUMNS]
    shown = ranks_worth_showing(ckpt)
    rows += [_row(r, ckpt, is_async) for r in ckpt.ranks if r.rank in shown]
    rows += [(str(rank), "no spans", *("",) * (len(rows[0]) - 2)) for rank in ckpt.silent_ranks[:_RANKS_SHOWN]]
    hosts = {r.rank: r.where for r in ckpt.ranks}
    if any(hosts.values()):  # where each rank ran, beside it
        rows = [(row[0], "host" if i == 0 else hosts.get(int(row[0].split()[0]), "") or "-", *row[1:])
                for i, row in enumerate(rows)]  # fmt: skip
    lines += _table(rows)
    if len(shown) < len(ckpt.ranks):
        rest = [r for r in ckpt.ranks if r.rank not in shown]
        lines.append(f"  ... {len(rest)} other ranks: total {min(r.duration_s for r in rest):.3f}s.."
                     f"{max(r.duration_s for r in rest):.3f}s, busy median {statistics.median(r.busy_s for r in rest):.3f}s")  # fmt: skip
    if ckpt.steps and len(ckpt.ranks) > 1:
        steps: list[tuple[str, ...]] = [("step", "slowest rank", "its time", "median", "skew")]
        for step in sorted(ckpt.steps, key=lambda s: -s.by_rank[s.slowest_rank]):
            steps.append((step.name, str(step.slowest_rank), f"{step.by_rank[step.slowest_rank]:.3f}s",
                          f"{step.median_s:.3f}s", f"{step.skew:.1f}x"))  # fmt: skip
        lines += _table(steps)
    if ckpt.collectives and len(ckpt.ranks) > 1:  # waiting for the others, and the objects DCP moved
        rows = [("DCP collective (step)", "longest on rank", "its time", "median", "objects moved")]
        rows += [(c.name, str(c.longest_rank), f"{c.by_rank[c.longest_rank]:.3f}s", f"{c.median_s:.3f}s",
                  format_bytes(c.moved_bytes) if c.moved_bytes else "-") for c in ckpt.collectives]  # fmt: skip
        lines += _table(rows)
    if ckpt.straggler is not None:
        lines.append(f"  straggler: rank {ckpt.straggler}, busy {ckpt.straggler_skew:.1f}x the median rank"
                     + (" (caller and upload)" if ckpt.operation in semconv.ASYNC_OPERATIONS else ""))
    skew = skew_line(ckpt)
    if skew:
        lines.append(f"  {skew}")
    said = interference_line(ckpt)
    if said:
        lines.append(f"  {said}")
    if ckpt.is_unfinished:
        lines += [f"  unfinished on rank {u.rank}: {u.description}"
                  + (f" ({u.stalls} stall report{'s' if u.stalls != 1 else ''})" if u.stalls else "")
                  for u in ckpt.unfinished[:_RANKS_SHOWN]]  # fmt: skip
        if len(ckpt.unfinished) > _RANKS_SHOWN:
            lines.append(f"  ... and {len(ckpt.unfinished) - _RANKS_SHOWN} more unfinished ranks")
    elif ckpt.failed_ranks:
        lines.append(f"  failed on rank {', '.join(map(str, ckpt.failed_ranks))}: {ckpt.error}")
        if ckpt.origins and ckpt.failed_waiting:
            lines.append(f"  it started on rank {', '.join(map(str, ckpt.origins))}; rank "
                         f"{', '.join(map(str, ckpt.failed_waiting))} failed waiting for it")  # fmt: skip
        elif ckpt.origins:
            lines.append(f"  it started on rank {', '.join(map(str, ckpt.origins))}; every other rank raised torch's "
                         f"{WRAPPER} reporting it")  # fmt: skip
        lost = ckpt.lost_peer()
        if lost:
            lines.append(f"  {lost}")
    return "\n".join(lines)


def interference_line(ckpt: Checkpoint) -> str | None:
    """``while step-1000 uploaded, 12 steps took 2.3x their usual 0.43 s: 6.2 s lost (rank 1)``, or ``None``."""
    found = ckpt.interference
    if found is None:
        return None
    rank, (steps, usual, ratio, lost) = found
    name = ckpt.checkpoint_id.rstrip("/").rpartition("/")[2] or "it"
    on = f" on rank {rank}" if len(ckpt.ranks) > 1 else ""
    took = f"while {name} uploaded, {steps} training step{'s' if steps != 1 else ''}{on} took {ratio:.2f}x their usual"
    if not lost:
        return f"{took} {usual:.3f} s: none lost beyond noise"
    total = ckpt.interference_s
    across = f"; {total:.2f} s across {len(ckpt.ranks)} ranks" if len(ckpt.ranks) > 1 and total > lost else ""
    return f"{took} {usual:.3f} s: {lost:.2f} s lost{across}"


def wall_clock(unix_ns: int) -> str:
    """``"2026-11-26 19:09:23.456 UTC"``: a time to find in the job's logs (UTC, as most log pipelines keep them)."""
    try:
        moment = datetime.datetime.fromtimestamp(unix_ns / 1e9, tz=datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):  # a time no calendar holds: a file that says anything
        return "?"
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def skew_line(ckpt: Checkpoint) -> str | None:
    """``"most skewed step: write_data on rank 7: 1.2s vs median 0.1s (12.0x)"`` (``None`` on one rank)."""
    worst = max(ckpt.steps, key=lambda s: (s.skew, s.median_s), default=None)
    if worst is None or len(worst.by_rank) < 2:
        return None
    return (f"most skewed step: {worst.name} on rank {worst.slowest_rank}: "
            f"{worst.by_rank[worst.slowest_rank]:.3f}s vs median {worst.median_s:.3f}s ({worst.skew:.1f}x)")  # fmt: skip


def ranks_worth_showing(ckpt: Checkpoint) -> set[int]:
    """Every rank of a small job; of a large one, the coordinator, the failed, the straggler and the slowest."""
    if len(ckpt.ranks) <= _RANKS_SHOWN:
        return {r.rank for r in ckpt.ranks}
    slowest = sorted(ckpt.ranks, key=lambda r: (-r.work_s, r.rank))[:_SLOWEST_SHOWN]
    keep = {0, *ckpt.failed_ranks, *(r.rank for r in slowest), *(r.rank for r in ckpt.ranks if r.error and
                                                                  not r.error.startswith("CheckpointException"))}
    if ckpt.straggler is not None:
        keep.add(ckpt.straggler)
    return keep


def rank_marks(rank: int, ckpt: Checkpoint) -> str:
    """`` <- failed here``, `` <- straggler``: what a rank was in its checkpoint."""
    marks = ["failed here"] if rank in ckpt.origins else []
    marks += ["straggler"] if rank == ckpt.straggler else []
    return f" <- {', '.join(marks)}" if marks else ""


def error_cell(r: RankResult, ckpt: Checkpoint) -> str:
    """A rank's error; torch's report of another rank's failure (which every rank raises) once, by reference."""
    if r.error and r.error.startswith(WRAPPER) and ckpt.origins and r.rank not in ckpt.origins:
        return f"{WRAPPER} (rank {', '.join(map(str, ckpt.origins))}'s failure)"
    return r.error or ""


def _row(r: RankResult, ckpt: Checkpoint, is_async: bool) -> tuple[str, ...]:
    mbps = f"{r.throughput_bps / 1e6:.1f}" if r.throughput_bps else "-"
    text = error_cell(r, ckpt)
    error = textwrap.shorten(text, _ERROR_WIDTH, placeholder=" ...") if text else ""
    head = (f"{r.rank}{rank_marks(r.rank, ckpt)}", f"{r.duration_s:.3f}s", f"{r.busy_s:.3f}s",
            f"{r.wait_s:.3f}s")  # fmt: skip
    if not is_async:
        return (*head, format_bytes(r.bytes), mbps, error)
    upload = f"{r.upload_s:.3f}s {r.upload}" if r.upload else "-"
    return (*head, f"{r.staging_s:.3f}s", upload, f"{r.upload_busy_s:.3f}s", f"{r.io_s:.3f}s", format_bytes(r.bytes),
            mbps, error)  # fmt: skip


def render_summary(summary: Summary) -> str:
    """The run in a few lines: counts, each unfinished checkpoint with where its ranks were, each failure
    with its full cause, the run's straggler, the trends."""
    failed = f"{len(summary.failures)} failed" if summary.failures else "none failed"
    unfinished = f"{len(summary.unfinished)} unfinished, " if summary.unfinished else ""
    lines = [f"{summary.operations} checkpoint operations ({summary.kinds}) on {summary.ranks_said} ranks: "
             f"{unfinished}{failed}"]  # fmt: skip
    if summary.silent_said:
        lines.append(summary.silent_said)
    for u in summary.unfinished[:FAILURES_SHOWN]:
        lines.append(f"UNFINISHED  {u.operation} {u.checkpoint_id or '(no id)'} (operation {u.index + 1} of "
                     f"{summary.operations}): {u.headline()}")  # fmt: skip
        for rank in u.stuck[:_STACKS_SHOWN]:
            if rank.stack:
                lines.append(f"        rank {rank.rank}, where it was (innermost last):")
                lines += [f"          {line}" for line in innermost_frames(rank.stack)]
    if len(summary.unfinished) > FAILURES_SHOWN:
        lines.append(f"        ... and {len(summary.unfinished) - FAILURES_SHOWN} more unfinished operations (details below)")
    for f in summary.failures[:FAILURES_SHOWN]:
        ranks = ", ".join(map(str, f.ranks)) or "?"
        lines.append(f"FAILED  {f.operation} {f.checkpoint_id or '(no id)'} (operation {f.index + 1} of "
                     f"{summary.operations}) on rank {ranks}:")  # fmt: skip
        if f.lost_peer:
            lines.append(f"        {f.lost_peer}")
        lines += [f"        {line}" for line in f.cause.strip().splitlines()[:_CAUSE_LINES]]
    if len(summary.failures) > FAILURES_SHOWN:
        lines.append(f"        ... and {len(summary.failures) - FAILURES_SHOWN} more failed operations (details below)")
    s = summary.straggler
    if s is not None:
        lines.append(f"straggler: rank {s.rank} was the slowest in {s.slowest_in} of {s.of} checkpoints, "
                     f"{s.median_skew:.1f}x the median rank")  # fmt: skip
    else:
        lines.append("straggler: no rank was the slowest in most checkpoints")
    lines.append("trend, oldest to newest:")
    rows: list[tuple[str, ...]] = [("operation", "count", "duration", "median", "range", "change", "checkpoint MB/s, median")]
    for t in summary.trends:
        change = t.change()
        rates = [v for v in t.throughputs_bps if v is not None]
        rows.append((t.operation, str(len(t.durations_s)), sparkline(t.durations_s), f"{t.median_s:.3f}s",
                     f"{min(t.durations_s):.3f}s..{max(t.durations_s):.3f}s",
                     "-" if change is None else f"{(change - 1) * 100:+.0f}%",
                     f"{statistics.median(rates) / 1e6:.1f}" if rates else "-"))  # fmt: skip
    lines += _table(rows)
    return "\n".join(lines)


def innermost_frames(stack: str, frames: int = _FRAMES_SHOWN) -> list[str]:
    """The last ``frames`` frames of a formatted Python stack, outside the standard library where it can,
    as lines (each ``File ...`` line with its source line)."""
    lines = [line.rstrip() for line in stack.strip().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    blocks = [lines[i : (starts[n + 1] if n + 1 < len(starts) else len(lines))] for n, i in enumerate(starts)]
    own = [b for b in blocks if not _is_stdlib(b[0])] or blocks
    return [line.strip() if line.lstrip().startswith("File ") else "  " + line.strip()
            for block in own[-frames:] for line in block]  # fmt: skip


def _is_stdlib(file_line: str) -> bool:
    return f'"{_STDLIB}' in file_line


def render_details(checkpoints: list[Checkpoint], limit: int | None = DETAIL_LIMIT) -> str:
    """The details of the worst ``limit`` checkpoints (``None``: all), worst first."""
    order = worst_first(checkpoints)
    shown = order if limit is None else order[:limit]
    more = len(checkpoints) - len(shown)
    head = (f"details, worst first: the {len(shown)} worst of {len(checkpoints)} (--all for every one)" if more
            else f"details, worst first ({len(checkpoints)})")  # fmt: skip
    return "\n\n".join([head, *(render_one(checkpoints[i]) for i in shown)])


def render(checkpoints: list[Checkpoint], limit: int | None = DETAIL_LIMIT, runs: list[Life] | None = None) -> str:
    """The summary, the runs' lives (where they say more than the summary), then the details of the worst
    ``limit`` checkpoints (``None``: all), worst first."""
    life = render_lives(runs or [])
    return (render_summary(summarize(checkpoints)) + (f"\n\n{life}" if life else "") + "\n\n"
            + render_details(checkpoints, limit) + "\n")


def render_lives(runs: list[Life]) -> str:
    """Each run's generations, its restarts and what checkpointing cost it; empty where no rank said its life
    (``dcp.process``) and nothing restarted."""
    lines: list[str] = []
    for life in runs:
        if len(life.generations) < 2 and not any(g.wall_s for g in life.generations):
            continue
        who = f" of run {life.run_id}" if len(runs) > 1 else ""
        lines.append(f"generations{who}: {len(life.generations)}, {life.duration_s:.1f} s; "
                     f"checkpointing cost {_cost(life.blocked_share, life.interference_share)}"
                     + (f"; lost to restarts {life.lost_to_restarts_s:.2f} s (work redone "
                        f"{sum(r.work_lost_s or 0.0 for r in life.restarts):.2f} s, down "
                        f"{sum(r.down_s or 0.0 for r in life.restarts):.2f} s)" if life.restarts else ""))  # fmt: skip
        for g in life.generations:
            per_rank = sum(g.blocked_s.values()) / len(g.blocked_s) if g.blocked_s else 0.0
            lines.append(f"  generation {g.number}: ranks {rank_ranges(g.ranks)}, {g.duration_s:.1f} s, checkpointing "
                         f"cost {_cost(g.blocked_share, g.interference_share)} ({per_rank:.2f} s blocked per rank); "
                         f"ended: {_endings(g)}")  # fmt: skip
            r = g.restore
            if r is None:
                continue
            if r.source is None:
                lines.append(f"    restored {r.load.checkpoint_id or '(no id)'}: no save of it in these traces")
                continue
            steps = f" ({r.steps_lost} steps)" if r.steps_lost is not None else ""
            lines.append(f"    restored {r.source.title.removeprefix(r.source.operation + ' ')}, saved by generation "
                         f"{r.source_generation}, {r.age_s:.2f} s old at restore; work lost {r.work_lost_s:.2f} s"
                         f"{steps}, down {r.down_s:.2f} s")  # fmt: skip
    return "\n".join(lines)


def _cost(blocked: float | None, interference: float | None) -> str:
    """``3.1% of wall time (blocked 1.2%, interference 1.9%)``: what checkpointing cost the training steps."""
    if blocked is None:
        return "-"
    if interference is None:
        return f"{_share(blocked)} of wall time (blocked {_share(blocked)}, interference not measured)"
    return f"{_share(blocked + interference)} of wall time (blocked {_share(blocked)}, interference {_share(interference)})"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f}%"


def _endings(g: Generation) -> str:
    """``"rank 1 exception (RuntimeError: boom), rank 0 SIGTERM"``, or ``"exit"`` when every rank exited."""
    by_how: dict[str, list[int]] = {}
    for rank, how in sorted(g.ended_by.items()):
        by_how.setdefault(how, []).append(rank)
    if list(by_how) == [semconv.ENDED_BY_EXIT]:
        return semconv.ENDED_BY_EXIT
    return "; ".join(f"rank {rank_ranges(ranks)} {how}" for how, ranks in by_how.items())
