"""The one configuration the rules, alerts and dashboards are generated from.

Thresholds, windows, selectors and dashboard uids live here, as in
kubernetes-mixin's ``_config``: change a field (or pass ``--<field>`` to
``python -m mixin``) and regenerate, and every rule, alert and panel agrees.

Usage::

    from mixin.config import MixinConfig

    cfg = MixinConfig(no_save_window="2h", selector='cluster="a"')
    cfg.sel()                       # -> '{cluster="a"}'
    cfg.sel('status="failure"')     # -> '{cluster="a",status="failure"}'
    MixinConfig().sel()             # -> ''
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

#: A Prometheus duration such as 90s, 15m, 1h or 1d (one unit: what the rules need).
_DURATION = re.compile(r"^[1-9][0-9]*(ms|s|m|h|d|w)$")
_UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
#: The trace backends a datasource is provisioned for, with their address in the compose file's network.
TRACE_BACKENDS = {"jaeger": "http://jaeger:16686", "tempo": "http://tempo:3200"}


@dataclass(frozen=True)
class MixinConfig:
    """Everything a team may tune; validated when built (a bad value is a ``ValueError``)."""

    #: Label matchers every rule and alert selects with (say ``cluster="prod"``); empty: all.
    selector: str = ""
    #: Window of the rates in recording rules.
    rate_window: str = "5m"
    #: "Recent" checkpoint statistics: the window a checkpoint's mean durations are taken over.
    recent_window: str = "15m"
    #: History a recent checkpoint is compared with (median of the recent means over it).
    baseline_window: str = "1d"
    #: Alert: a save (or async save) has not succeeded for this long.
    no_save_window: str = "1h"
    #: Alert: how far back a failed operation still fires.
    failure_window: str = "15m"
    #: Alert: a checkpoint took this many times its recent median ...
    slow_factor: float = 2.0
    #: ... and at least this many seconds (short checkpoints vary a lot, harmlessly).
    slow_min_seconds: float = 30.0
    #: Alert: one rank's write/read step this many times the median across ranks ...
    straggler_factor: float = 2.0
    #: ... and at least this many seconds.
    straggler_min_seconds: float = 10.0
    #: Alert: no save succeeded for this many times the run's usual interval between saves (recovery point too old).
    recovery_point_factor: float = 3.0
    #: Dashboard: the window the share of training time blocked by checkpoint calls is averaged over.
    blocked_window: str = "1h"
    #: Alert: async saves in flight with none finished for this long.
    stuck_async_window: str = "30m"
    #: Per-rank panels draw at most this many ranks per run (topk/bottomk): 1,024 ranks are 1,024 series.
    per_rank_limit: int = 10
    #: Per-rank tables list at most this many rows per run, worst first.
    per_rank_rows: int = 50
    #: Dashboard uids (stable: links and bookmarks point at them).
    checkpoints_uid: str = "dcp-otel-checkpoints"
    ranks_uid: str = "dcp-otel-ranks"
    agent_uid: str = "dcp-otel-torchelastic"
    #: The trace datasource exemplars and the dashboards' "Checkpoint traces" link open: its uid, and its
    #: type, ``jaeger`` or ``tempo`` (grafana/provisioning/datasources provisions one of each).
    traces_datasource_uid: str = "dcp-otel-traces"
    traces_datasource_type: str = "jaeger"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_window") and not _DURATION.match(value):
                raise ValueError(f"{f.name} must be a Prometheus duration like 15m or 1h, got {value!r}")
            if f.name.endswith("_factor") and not value > 1:
                raise ValueError(f"{f.name} must be greater than 1, got {value!r}")
            if f.name.endswith("_seconds") and not value >= 0:
                raise ValueError(f"{f.name} must be at least 0, got {value!r}")
            if f.name.endswith("_uid") and not _UID.match(value):
                raise ValueError(f"{f.name} must be 1 to 40 letters, digits, '-' or '_', got {value!r}")
        for name in ("per_rank_limit", "per_rank_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        if seconds(self.baseline_window) <= max(seconds(self.recent_window), seconds(self.no_save_window)):
            raise ValueError("baseline_window must be longer than recent_window and no_save_window")
        if self.traces_datasource_type not in TRACE_BACKENDS:
            raise ValueError(f"traces_datasource_type must be one of {', '.join(TRACE_BACKENDS)}, "
                             f"got {self.traces_datasource_type!r}")  # fmt: skip
        if any(c in self.selector for c in "{}"):
            raise ValueError(f"selector takes label matchers without braces, got {self.selector!r}")

    def sel(self, *matchers: str) -> str:
        """``{selector,matchers...}``: the braces of a series selector (empty without matchers)."""
        parts = [m for m in (self.selector, *matchers) if m]
        return "{" + ",".join(parts) + "}" if parts else ""


_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def seconds(duration: str) -> float:
    """``seconds("15m") == 900``: a duration of the config in seconds."""
    match = _DURATION.match(duration)
    if match is None:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    unit = match.group(1)
    return int(duration[: -len(unit)]) * _UNIT_SECONDS[unit]
