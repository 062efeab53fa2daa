"""The report as a terminal table: one block per checkpoint operation.

Usage::

    print(render(checkpoints(spans)))
"""

from __future__ import annotations

import textwrap

from dcp_otel.report.model import Checkpoint, RankResult

#: A save or load: total = busy + waiting.
_COLUMNS = ("rank", "total", "busy", "waiting", "bytes", "MB/s", "error")
#: An async save, its two sides apart: the caller's (returned = busy + waiting, staging part of busy)
#: and the upload's (write part of upload busy, part of upload).
_ASYNC_COLUMNS = ("rank", "returned", "busy", "waiting", "staging", "upload", "upload busy", "write", "bytes",
                  "MB/s", "error")  # fmt: skip
#: The error column is cut at a word; the whole error is on the "failed on rank" line.
_ERROR_WIDTH = 60


def format_bytes(n: int) -> str:
    """``format_bytes(1_572_864) == "1.5 MB"`` (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render_one(ckpt: Checkpoint) -> str:
    status = "FAILED" if ckpt.error else "ok"
    lines = [f"{ckpt.operation} {ckpt.checkpoint_id or '(no id)'}  {ckpt.duration_s:.3f} s  {status}  "
             f"trace {ckpt.trace_id}"]  # fmt: skip
    is_async = ckpt.operation == "async_save"
    rows: list[tuple[str, ...]] = [_ASYNC_COLUMNS if is_async else _COLUMNS]
    rows += [_row(r, r.rank == ckpt.straggler, is_async) for r in ckpt.ranks]
    lines += _table(rows)
    if ckpt.steps and len(ckpt.ranks) > 1:
        steps: list[tuple[str, ...]] = [("step", "slowest rank", "its time", "median", "skew")]
        for step in sorted(ckpt.steps, key=lambda s: -s.by_rank[s.slowest_rank]):
            steps.append((step.name, str(step.slowest_rank), f"{step.by_rank[step.slowest_rank]:.3f}s",
                          f"{step.median_s:.3f}s", f"{step.skew:.1f}x"))  # fmt: skip
        lines += _table(steps)
    if ckpt.straggler is not None:
        lines.append(f"  straggler: rank {ckpt.straggler}, busy {ckpt.straggler_skew:.1f}x the median rank"
                     + (" (caller and upload)" if ckpt.operation == "async_save" else ""))
    worst = max(ckpt.steps, key=lambda s: (s.skew, s.median_s), default=None)
    if worst is not None and len(worst.by_rank) > 1:
        lines.append(f"  most skewed step: {worst.name} on rank {worst.slowest_rank}: "
                     f"{worst.by_rank[worst.slowest_rank]:.3f}s vs median {worst.median_s:.3f}s ({worst.skew:.1f}x)")  # fmt: skip
    if ckpt.failed_ranks:
        lines.append(f"  failed on rank {', '.join(map(str, ckpt.failed_ranks))}: {ckpt.error}")
    return "\n".join(lines)


def _row(r: RankResult, straggler: bool, is_async: bool) -> tuple[str, ...]:
    mbps = f"{r.throughput_bps / 1e6:.1f}" if r.throughput_bps else "-"
    error = textwrap.shorten(r.error, _ERROR_WIDTH, placeholder=" ...") if r.error else ""
    head = (f"{r.rank}{' <- straggler' if straggler else ''}", f"{r.duration_s:.3f}s", f"{r.busy_s:.3f}s",
            f"{r.wait_s:.3f}s")  # fmt: skip
    if not is_async:
        return (*head, format_bytes(r.bytes), mbps, error)
    upload = f"{r.upload_s:.3f}s {r.upload}" if r.upload else "-"
    return (*head, f"{r.staging_s:.3f}s", upload, f"{r.upload_busy_s:.3f}s", f"{r.io_s:.3f}s", format_bytes(r.bytes),
            mbps, error)  # fmt: skip


def render(checkpoints: list[Checkpoint]) -> str:
    head = f"{len(checkpoints)} checkpoint operations, {len({r.rank for c in checkpoints for r in c.ranks})} ranks"
    return "\n\n".join([head, *(render_one(c) for c in checkpoints)]) + "\n"
