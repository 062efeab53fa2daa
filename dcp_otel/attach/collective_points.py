"""DCP's object collectives at the points dcp-otel patches: their spans, the step naming them, their bytes.

Hot patches (every collective of every save, on the training thread): each is a *replacer*
(:class:`~dcp_otel.attach.patches.Patch`), one frame per call.

* ``_DistWrapper.gather_object`` and its kin: a ``dcp.collective.<method>`` span each; a save's write
  gather carries this rank's arrival mark to the coordinator (:mod:`dcp_otel.attach.arrivals`);
* ``_DistWrapper.reduce_scatter("plan", ...)`` and its kin: the step that names their collectives;
* ``_object_to_tensor`` / ``_tensor_to_object``: the bytes torch pickled for DCP's collective.

Usage (what :data:`dcp_otel.attach.patches.PATCHES` lists)::

    Patch(DCP_UTILS, "_DistWrapper.gather_object", "...", collective_wrapper("gather_object"), hot=True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dcp_otel import semconv
from dcp_otel.attach import arrivals
from dcp_otel.attach.wrapping import Replacer
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.records import Call
from dcp_otel.tracing.tracker import SpanRecorder

if TYPE_CHECKING:
    from dcp_otel.attach.patches import Hooks


def collective_wrapper(method: str) -> Callable[[Hooks], Replacer]:
    """One of ``_DistWrapper``'s object collectives, as a ``dcp.collective.<method>`` span (a hot patch)."""

    def make(hooks: Hooks) -> Replacer:
        recorder = hooks.recorder
        gathers = method == "gather_object"

        def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
            def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
                if gathers:  # this rank's write results or read plan, on their way to the coordinator
                    recorder.on_gathered(args[0] if args else kwargs.get("object"), getattr(self, "group", None))
                # Without torch.distributed (a single process) DCP's wrapper makes no collective at all.
                call = recorder.collective_started(method) if getattr(self, "use_dist", True) else None
                if call is None:
                    return original(self, *args, **kwargs)
                try:
                    if gathers and call.extra is not None and call.extra.get(_STEP) == "write" and len(args) == 1:
                        result = _gather_write_results(recorder, original, self, args[0], call)
                    else:
                        result = original(self, *args, **kwargs)
                except BaseException as exc:
                    recorder.collective_ended(call, exc)
                    raise
                recorder.collective_ended(call, None)
                return result

            return replacement

        return replacer

    return make


_STEP = semconv.ATTR_COLLECTIVE_STEP


def _gather_write_results(recorder: SpanRecorder, original: Callable[..., Any], wrapper: Any, results: Any,
                          call: Call) -> Any:  # fmt: skip
    """A save's write gather: the results go with this rank's mark, and the coordinator notes every rank's
    (:mod:`dcp_otel.attach.arrivals`). DCP gets back exactly what it would have without dcp-otel."""
    op = call.op
    if op is not None and op.released_ns:  # since the plan released this rank (no plan collective: no mark)
        results = arrivals.tag(results, op.rank, call.start_ns - op.released_ns)
    if not getattr(wrapper, "is_coordinator", False):
        return original(wrapper, results)
    with arrivals.receiving() as marks:
        gathered = original(wrapper, results)
    recorder.on_arrivals(call, marks)
    return gathered


def collective_scope_wrapper(pattern: str) -> Callable[[Hooks], Replacer]:
    """``_DistWrapper.reduce_scatter("plan", ...)`` and its kin: their collectives belong to torch's step (hot)."""

    def make(hooks: Hooks) -> Replacer:
        recorder = hooks.recorder

        def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
            def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
                previous = recorder.collective_scope(pattern, args[0] if args else kwargs.get("step"))
                try:
                    return original(self, *args, **kwargs)
                finally:
                    recorder.end_collective_scope(previous)

            return replacement

        return replacer

    return make


def object_bytes_wrapper(sent: bool) -> Callable[[Hooks], Replacer]:
    """torch.distributed pickles (``sent``) or unpickles an object of a collective: its bytes, counted on
    DCP's collective this thread is in (``_object_to_tensor`` returns the byte tensor; ``_tensor_to_object``
    is given its ``tensor_size``)."""

    def make(hooks: Hooks) -> Replacer:
        recorder = hooks.recorder

        def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
            def replacement(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                call = recorder.current_collective()
                if call is not None:
                    try:
                        if sent:
                            call.sent_bytes += int(result[0].numel())
                        else:
                            call.received_bytes += int(args[1] if len(args) > 1 else kwargs["tensor_size"])
                    except Exception as exc:  # noqa: BLE001 - a torch whose functions differ: no bytes, no harm
                        reraise_if_signalled(exc)
                return result

            return replacement

        return replacer

    return make
