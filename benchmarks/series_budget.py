"""How many series dcp-otel costs Prometheus: per rank, and for 1,000 and 10,000 ranks.

    .venv/bin/python benchmarks/series_budget.py

Counts the samples one rank exposes after a save, an async save and a load (the
shape of every rank's exposition: DCP's steps are the same on every rank), per
metric family, then applies the drop rules of our two scrape configs
(exporters/prometheus/prometheus.yml and large-jobs.yml) as Prometheus would
(anchored regexes on ``__name__``).
"""

from __future__ import annotations

import re
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

import dcp_otel

PROMETHEUS = Path(__file__).resolve().parent.parent / "exporters" / "prometheus"
PROFILES = {"prometheus.yml": PROMETHEUS / "prometheus.yml", "large-jobs.yml": PROMETHEUS / "large-jobs.yml"}


def one_rank_samples() -> list[str]:
    """Sample names one rank exposes after a save, an async save and a load."""
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=registry)
    try:
        with tempfile.TemporaryDirectory() as root:
            state = {"w": torch.ones(16)}
            dcp.save(state, checkpoint_id=f"{root}/a")
            dcp.async_save(state, checkpoint_id=f"{root}/b").result()
            dcp.load(state, checkpoint_id=f"{root}/a")
            dcp_otel.flush(timeout_s=30)
        return [s.name for metric in registry.collect() for s in metric.samples]
    finally:
        dcp_otel.uninstrument()


def drop_rules(config: Path, job: str = "dcp-otel") -> list[re.Pattern[str]]:
    scrape = {j["job_name"]: j for j in yaml.safe_load(config.read_text())["scrape_configs"]}[job]
    return [re.compile(f"(?:{rule['regex']})") for rule in scrape.get("metric_relabel_configs", [])
            if rule.get("action") == "drop" and rule.get("source_labels") == ["__name__"]]  # fmt: skip


def kept(names: list[str], rules: list[re.Pattern[str]]) -> list[str]:
    return [n for n in names if not any(rule.fullmatch(n) for rule in rules)]


def main() -> None:
    warnings.simplefilter("ignore")
    names = one_rank_samples()
    profiles = {name: kept(names, drop_rules(path)) for name, path in PROFILES.items()}
    print(f"series per rank, by family (torch {torch.__version__}; after a save, an async save and a load)")
    families = Counter(re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in names)
    print(f"  {'family':42} {'exposed':>8} " + " ".join(f"{p:>15}" for p in profiles))
    for family, count in sorted(families.items()):
        row = [sum(1 for n in kept_names if re.sub(r"_(bucket|sum|count|total|created)$", "", n) == family)
               for kept_names in profiles.values()]  # fmt: skip
        print(f"  {family:42} {count:>8} " + " ".join(f"{c:>15}" for c in row))
    print(f"  {'total per rank':42} {len(names):>8} " + " ".join(f"{len(k):>15}" for k in profiles.values()))
    for ranks in (1_000, 10_000):
        print(f"  {f'x {ranks:,} ranks':42} {len(names) * ranks:>8,} "
              + " ".join(f"{len(k) * ranks:>15,}" for k in profiles.values()))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
