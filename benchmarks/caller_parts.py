"""Two parts of the caller's bill, each beside a bare span timed the same way in the same run.

    .venv/bin/python benchmarks/caller_parts.py [--repeats 15]

* an operation's start and end: the two records DCP logs for ``dcp.save`` (with the fields torch
  gives them in a gloo job: this process is a gloo world of one), handed to dcp-otel's tap, with the
  finished operation kept from the builder: what the training thread pays to begin and end a
  checkpoint's trace, whatever its steps;
* the core of the design that would bring a real save under 5 bare spans (not built; see
  docs/performance.md): 20 raw records appended to a per-thread log and 10 light spans made current,
  all a save's records would cost the training thread if pairing moved to the builder;
* a method call through a ``wrapt`` wrapper, and through a plain function calling a wrapper in wrapt's
  signature (how dcp-otel wrapped DCP's collectives before), each less the same call through a
  replacement as dcp-otel's patches now put in a collective's place (``wrapping.replace_plainly``:
  one frame, calling the original directly): what each step saved per call.

The unit is a bare SDK span: ``start_span`` with four attributes, made current, detached, ended,
through a batch processor. Each figure is the median of ``--repeats`` interleaved loops (training
thread CPU time). What it leaves out: both are loops (warm caches), a lower bound of what the same
work costs amid a real save; ``fixed_cost.py`` measures a whole save.
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import random
import sys
import time
import types
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed.checkpoint.logger as dcp_logger  # noqa: E402
import wrapt  # noqa: E402
from opentelemetry import context, trace  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

import dcp_otel  # noqa: E402
from dcp_otel.attach.wrapping import replace_plainly  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, interleave, median, per_call  # noqa: E402
from fixed_cost import gloo_world_of_one  # noqa: E402

_ATTRIBUTES = {"dcp.rank": 0, "dcp.checkpoint_id": "/dev/shm/checkpoints/step-1000", "dcp.operation": "save",
               "dcp.world_size": 1}  # fmt: skip
#: The fields torch's _dcp_method_logger puts on a save's records in a gloo job (besides event, uuid, time),
#: as torch 2.13 gives them (its ``_get_msg_dict``: strings) when torch.distributed is initialized.
_FIELDS = {"func_name": "save", "checkpoint_id": "/dev/shm/checkpoints/step-1000", "pg_name": "None", "backend": "gloo",
           "world_size": "1", "group_size": "1", "global_rank": "0", "local_rank": "0", "log_exceptions": True}  # fmt: skip


def measure(repeats: int = 15, calls: int = 300) -> dict[str, float]:
    """Median CPU ns per call: ``bare`` span, ``operation`` start and end, ``records`` (both records
    built, not handed on: subtracted from ``operation``), ``core`` of the design."""
    warnings.simplefilter("ignore")
    # A job's operation: torch.distributed initialized (the ranks agree on their round's generation).
    with gloo_world_of_one() as (provider, exporter):
        tracer = provider.get_tracer("bench")
        dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), detail="full")
        tap: Any = dcp_logger._dcp_logger
        builder = dcp_otel.DCPInstrumentor().recorder.builder
        builder.submit = lambda op, calls=None: None  # the builder's work is not the caller's (fixed_cost.py has it)

        def bare() -> None:
            span = tracer.start_span("dcp.write_data", attributes=_ATTRIBUTES)
            token = context.attach(trace.set_span_in_context(span))
            context.detach(token)
            span.end()

        def records() -> tuple[dict[str, Any], dict[str, Any]]:
            call, now = uuid.uuid4().hex, time.time_ns()
            return ({**_FIELDS, "event": "start", "uuid": call, "time": now},
                    {**_FIELDS, "event": "end", "uuid": call, "time": now + 1_000})  # fmt: skip

        def operation() -> None:
            start, end = records()
            tap.feed(start)
            tap.feed(end)

        variable: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("light_span")
        log: collections.deque[tuple[str, str, str, int]] = collections.deque(maxlen=100_000)

        def core() -> None:  # a save's 20 records: 10 starts (each a light span made current), 10 ends
            tokens = []
            for _ in range(10):
                log.append(("5b0c8e3a", "write_data", "start", 1))
                tokens.append(variable.set((0x1234, random.getrandbits(64))))
            for token in reversed(tokens):
                log.append(("5b0c8e3a", "write_data", "end", 2))
                variable.reset(token)

        def passing(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return wrapped(*args, **kwargs)

        class Wrapped:
            def gather_object(self, obj: object) -> object:
                return obj

        class Plain:
            def gather_object(self, obj: object) -> object:
                return obj

        wrapt.wrap_function_wrapper(Wrapped, "gather_object", passing)
        original = vars(Plain)["gather_object"]

        def plain_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return passing(types.MethodType(original, self), self, args, kwargs)

        Plain.gather_object = plain_wrapper  # type: ignore[method-assign]

        class Replaced:
            def gather_object(self, obj: object) -> object:
                return obj

        def passing_replacer(original: Callable[..., Any]) -> Callable[..., Any]:
            def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
                return original(self, *args, **kwargs)

            return replacement

        assert replace_plainly(Replaced, "gather_object", passing_replacer)
        wrapped_one, plain_one, replaced_one = Wrapped(), Plain(), Replaced()

        parts: dict[str, Callable[[], Any]] = {"bare": bare, "operation": operation, "records": records, "core": core,
                                               "wrapt": lambda: wrapped_one.gather_object(1),
                                               "plain wrapper": lambda: plain_one.gather_object(1),
                                               "replacement": lambda: replaced_one.gather_object(1)}  # fmt: skip

        def flushed() -> None:  # (the spans made so far exported and dropped, untimed: none piles up for the next)
            provider.force_flush()
            exporter.clear()

        def timed(fn: Callable[[], Any]) -> Callable[[], Measures]:
            return lambda: {"ns": per_call(fn, calls, time.thread_time_ns)}  # the training thread's CPU

        try:
            found = interleave({name: timed(fn) for name, fn in parts.items()}, repeats, warm=1, between=flushed)
        finally:
            del builder.submit
            dcp_otel.uninstrument()
    return {name: median(found, name, "ns") for name in parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved loops per arm")
    args = parser.parse_args()
    m = measure(args.repeats)
    bare, op = m["bare"], m["operation"] - m["records"]
    print(f"parts of the caller's bill (medians of {args.repeats} interleaved loops; a bare span: {bare / 1e3:.1f} us)")
    print(f"  {'an operation start and end, through the tap':<58} {op / 1e3:7.1f} us = {op / bare:.2f} bare spans")
    print(f"  {'the design core: 20 raw records, 10 light spans current':<58} {m['core'] / 1e3:7.1f} us = "
          f"{m['core'] / bare:.2f} bare spans")  # fmt: skip
    for arm, said in (("wrapt", "a call through wrapt, less through a replacement"),
                      ("plain wrapper", "through a plain wrapper, less through a replacement")):  # fmt: skip
        extra = m[arm] - m["replacement"]
        print(f"  {said:<58} {extra / 1e3:7.2f} us = {extra / bare:.3f} bare spans ({arm} "
              f"{m[arm] / 1e3:.2f} us, replacement {m['replacement'] / 1e3:.2f} us a call)")  # fmt: skip


if __name__ == "__main__":
    main()
