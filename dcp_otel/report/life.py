"""The run's life across restarts: its generations, what each restart restored and lost, what checkpointing cost.

A job that fails and restarts (torchrun ``--max-restarts``, a requeued SLURM
job) runs as generations of workers, each with its own ``dcp.generation``.
From the checkpoints' spans and each rank's ``dcp.process`` span (its life
from ``instrument()`` to its end: :mod:`dcp_otel.live.life`), this answers:

- per generation: its ranks, how each ended (exit, an exception, SIGTERM, or
  no end recorded: killed), its wall time, and the share of it the training
  thread spent blocked in DCP calls (a save whole, an async save until it
  returned, a load);
- per restart: the checkpoint it restored (its first load), the save that
  wrote it and in which generation, its age at restore, the work lost (from
  the end of that save to the last sign of life of the generation that died;
  in steps too, where the training loop said them), and how long the job was
  down (from that death until the restore's end);
- for the run: the share of wall time blocked by checkpointing, and the time
  lost to restarts (work redone plus time down).

The wall time of a generation is known from its ``dcp.process`` spans; a
generation without them (its processes were killed, or an older dcp-otel
wrote its spans) gives its blocked seconds but no share. Time before
``instrument()`` (imports, the process group's start) is left out.

Usage::

    for life in lives(checkpoints(spans), spans):
        for g in life.generations:
            print(g.number, g.blocked_share, g.restore and g.restore.work_lost_s)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan
from dcp_otel.report.model import Checkpoint
from dcp_otel.report.values import as_number, rank_of

#: How a rank with no ``dcp.process`` span ended, as the report says it.
NO_END: str = "no end recorded"
#: An exception's message is cut to this many characters (its span holds it whole).
_SAID = 80


@dataclass
class Restore:
    """What a generation loaded first, and what the restart that led to it lost."""

    load: Checkpoint
    source: Checkpoint | None  # the last successful save of that checkpoint id before the load
    source_generation: int | None  # its generation's number
    age_s: float | None  # from the save's end (durable) to the load's start
    work_lost_s: float | None  # from the save's end to the last sign of life of the generation before
    steps_lost: int | None  # that generation's last training step minus the restored one
    down_s: float | None  # from that last sign of life to the load's end: restarting and restoring

    @property
    def lost_s(self) -> float:
        """Time this restart cost: work redone plus time down."""
        return (self.work_lost_s or 0.0) + (self.down_s or 0.0)


@dataclass
class Generation:
    """One round of workers."""

    number: int  # 1 for the first, oldest first
    key: str  # its dcp.generation ("": the spans say none)
    start_ns: int  # its first sign of life: a process span's start, else its first checkpoint's
    end_ns: int  # its last sign of life: a process span's end, else its last checkpoint's
    checkpoints: list[Checkpoint]
    ended_by: dict[int, str]  # rank -> exit, exception (with its message), a signal's name, or NO_END
    blocked_s: dict[int, float]  # rank -> seconds its training thread spent in DCP calls
    wall_s: dict[int, float]  # rank -> its process span's length (ranks with one)
    last_step: int | None  # the last training step its process spans said (the training loop's own)
    restore: Restore | None = None
    #: rank -> seconds its training steps lost to checkpoints' background work (interference), where measured
    interference_s: dict[int, float] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def ranks(self) -> list[int]:
        return sorted(self.ended_by)

    @property
    def blocked_share(self) -> float | None:
        """Blocked seconds over wall seconds, over the ranks whose wall time is known (``None``: none is)."""
        wall = sum(self.wall_s.values())
        return sum(self.blocked_s.get(r, 0.0) for r in self.wall_s) / wall if wall > 0 else None

    @property
    def interference_share(self) -> float | None:
        """Seconds steps lost to background work over wall seconds (``None``: no wall time, or none measured)."""
        wall = sum(self.wall_s.values())
        lost = [self.interference_s[r] for r in self.wall_s if r in self.interference_s]
        return sum(lost) / wall if wall > 0 and lost else None

    @property
    def failed(self) -> bool:
        return any(how != semconv.ENDED_BY_EXIT for how in self.ended_by.values())


@dataclass
class Life:
    """One run (``dcp.run_id``) across its generations."""

    run_id: str
    generations: list[Generation] = field(default_factory=list)

    @property
    def blocked_share(self) -> float | None:
        wall = sum(w for g in self.generations for w in g.wall_s.values())
        blocked = sum(g.blocked_s.get(r, 0.0) for g in self.generations for r in g.wall_s)
        return blocked / wall if wall > 0 else None

    @property
    def interference_share(self) -> float | None:
        wall = sum(w for g in self.generations for w in g.wall_s.values())
        lost = [g.interference_s[r] for g in self.generations for r in g.wall_s if r in g.interference_s]
        return sum(lost) / wall if wall > 0 and lost else None

    @property
    def restarts(self) -> list[Restore]:
        return [g.restore for g in self.generations[1:] if g.restore is not None]

    @property
    def lost_to_restarts_s(self) -> float:
        return sum(r.lost_s for r in self.restarts)

    @property
    def duration_s(self) -> float:
        return (self.generations[-1].end_ns - self.generations[0].start_ns) / 1e9 if self.generations else 0.0


def lives(checkpoints: list[Checkpoint], spans: list[FileSpan]) -> list[Life]:
    """Each run's life (``checkpoints`` as :func:`~dcp_otel.report.model.checkpoints` gives them)."""
    groups: dict[tuple[str, str], tuple[list[Checkpoint], list[FileSpan]]] = defaultdict(lambda: ([], []))
    for ckpt in checkpoints:
        groups[_who(ckpt.spans)][0].append(ckpt)
    for span in spans:
        if span.name == semconv.SPAN_PROCESS and rank_of(span) is not None:
            groups[_who([span])][1].append(span)
    by_run: dict[str, list[Generation]] = defaultdict(list)
    for (run_id, key), (ckpts, processes) in groups.items():
        by_run[run_id].append(_generation(key, ckpts, processes))
    found = []
    for run_id, generations in by_run.items():
        generations.sort(key=lambda g: g.start_ns)
        for number, g in enumerate(generations, 1):
            g.number = number
        for before, g in zip(generations, generations[1:], strict=False):
            g.restore = _restore(g, before, generations)
        found.append(Life(run_id, generations))
    return sorted(found, key=lambda life: life.generations[0].start_ns)


def _who(spans: list[FileSpan]) -> tuple[str, str]:
    """(run id, generation) of a checkpoint's or a process's spans."""
    for span in spans:
        if semconv.ATTR_RUN_ID in span.attributes:
            return str(span.attributes[semconv.ATTR_RUN_ID]), str(span.attributes.get(semconv.ATTR_GENERATION, ""))
    return "", ""


def _generation(key: str, ckpts: list[Checkpoint], processes: list[FileSpan]) -> Generation:
    ended_by: dict[int, str] = {}
    wall: dict[int, float] = {}
    steps: list[int] = []
    for span in processes:
        rank = rank_of(span)
        assert rank is not None
        how = str(span.attributes.get(semconv.ATTR_ENDED_BY, NO_END))
        said = span.status_message.strip().splitlines()[0] if span.status_message.strip() else ""
        said = said if len(said) <= _SAID else said[: _SAID - 3] + "..."
        ended_by[rank] = f"{how} ({said})" if how == semconv.ENDED_BY_EXCEPTION and said else how
        wall[rank] = wall.get(rank, 0.0) + span.duration_s
        step = as_number(span.attributes.get(semconv.ATTR_TRAINING_STEP))
        if step is not None and step >= 0:
            steps.append(int(step))
    blocked: dict[int, float] = defaultdict(float)
    interference: dict[int, float] = defaultdict(float)
    for ckpt in ckpts:
        for r in ckpt.ranks:
            blocked[r.rank] += r.duration_s  # the operation span: an async save's until it returned
            if r.interference is not None:
                interference[r.rank] += r.interference[3]
            ended_by.setdefault(r.rank, NO_END)
    starts = [s.start_ns for s in processes] + [c.start_ns for c in ckpts]
    ends = [s.end_ns for s in processes] + [c.end_ns for c in ckpts]
    return Generation(0, key, min(starts), max(ends), sorted(ckpts, key=lambda c: c.start_ns), ended_by,
                      dict(blocked), wall, max(steps, default=None), interference_s=dict(interference))  # fmt: skip


def _durable(ckpt: Checkpoint) -> bool:
    """A save that succeeded on every rank that told, its uploads included."""
    return (ckpt.operation in semconv.SAVE_OPERATIONS and not ckpt.error and not ckpt.is_unfinished and bool(ckpt.ranks)
            and all(r.upload in (None, "completed") for r in ckpt.ranks))  # fmt: skip


def _restore(g: Generation, before: Generation, generations: list[Generation]) -> Restore | None:
    load = next((c for c in g.checkpoints if c.operation in semconv.LOAD_OPERATIONS and not c.error), None)
    if load is None:
        return None
    saves = [(c, other) for other in generations for c in other.checkpoints
             if _durable(c) and c.checkpoint_id == load.checkpoint_id and c.end_ns <= load.start_ns]  # fmt: skip
    source, written_by = max(saves, key=lambda pair: pair[0].end_ns, default=(None, None))
    steps = None
    if source is not None and source.training_step is not None and before.last_step is not None:
        steps = max(0, before.last_step - source.training_step)
    return Restore(
        load=load,
        source=source,
        source_generation=written_by.number if written_by is not None else None,
        age_s=(load.start_ns - source.end_ns) / 1e9 if source is not None else None,
        work_lost_s=max(0.0, (before.end_ns - source.end_ns) / 1e9) if source is not None else None,
        steps_lost=steps,
        down_s=max(0.0, (load.end_ns - before.end_ns) / 1e9),
    )
