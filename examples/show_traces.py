"""Summarize the checkpoint traces in a folder of span files (one JSON span per line).

    python examples/show_traces.py out/quickstart

For each checkpoint trace: the operation, its checkpoint, and per rank the
operation's duration and its slowest step. (The full offline report is
``dcp-otel report``, to come.)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path


def ns(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e9)


def main(folder: Path) -> int:
    spans = []
    for path in sorted(folder.glob("spans-*.jsonl")):
        spans += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    traces: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        traces[span["context"]["trace_id"]].append(span)
    found = 0
    for trace_id, members in sorted(traces.items(), key=lambda kv: min(ns(s["start_time"]) for s in kv[1])):
        roots = [s for s in members if s["name"] == "dcp.checkpoint"]
        if not roots:
            continue
        found += 1
        root = roots[0]
        attrs = root["attributes"]
        took = (ns(root["end_time"]) - ns(root["start_time"])) / 1e6
        status = root["status"]["status_code"]
        print(f"\ntrace {trace_id[2:]}  {attrs['dcp.operation']}  {attrs['dcp.checkpoint_id']}  {took:.1f} ms  {status}")
        ops = [s for s in members if s["parent_id"] == root["context"]["span_id"]]
        for op in sorted(ops, key=lambda s: s["attributes"]["dcp.rank"]):
            steps = [s for s in members if s["parent_id"] == op["context"]["span_id"]]
            slowest = max(steps, key=lambda s: ns(s["end_time"]) - ns(s["start_time"]), default=None)
            slow = ""
            if slowest is not None:
                slow = f"slowest step {slowest['name']} {(ns(slowest['end_time']) - ns(slowest['start_time'])) / 1e6:.1f} ms"
            op_ms = (ns(op["end_time"]) - ns(op["start_time"])) / 1e6
            print(f"  rank {op['attributes']['dcp.rank']}: {op['name']:<15} {op_ms:8.1f} ms  {len(steps)} child spans  {slow}")
    print(f"\n{found} checkpoint traces, {len(spans)} spans, files in {folder}")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/quickstart")))
