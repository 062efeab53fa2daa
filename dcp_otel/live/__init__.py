"""What is open now: live progress, the stall watchdog, and the calls still open at exit.

A checkpoint that never finishes leaves no span when only finished calls are
built. This package reads what the recorder already holds, its open calls,
from outside the caller's thread:

* :mod:`~dcp_otel.live.progress`: where each open operation is (its innermost
  open step, since when, which thread is inside it), and each operation's stall
  threshold; read by the metrics collections
  (``dcp_in_progress_since_timestamp_seconds``) and by the watchdog;
* :mod:`~dcp_otel.live.stacks`: the Python stack of the thread inside a call,
  and the collective it is blocked in, if any;
* :mod:`~dcp_otel.live.stalls`: one stall report (a ``dcp.stall`` span exported
  at once, ``dcp_stalls_total``, one warning, the stack into the process's record);
* :mod:`~dcp_otel.live.ending`: ending every open call as failed when the
  process exits normally;
* :mod:`~dcp_otel.live.life`: the process's ``dcp.process`` span at its exit;
* :mod:`~dcp_otel.live.signal_exceptions`: what a signal handler raised (torchelastic's
  ``SignalException``) is the application's: every ``except Exception`` of dcp-otel
  raises it again (it runs inside those clauses, on the caller's main thread);
* :mod:`~dcp_otel.live.watchdog`: the one background thread per process that
  ties them together, and writes a heartbeat into the process's record.

dcp-otel installs no signal handler: a process killed by a signal ends as it
would without it, and what it had open is reported by a survivor from its
record (:mod:`dcp_otel.spool`). Nothing here runs on the caller's thread,
takes part in a collective, or touches a torch object.

Usage (what :class:`dcp_otel.DCPInstrumentor` does)::

    live = LiveState(recorder, StallPolicy(options.stall_after_s, recorder.builder.history))
    watchdog = Watchdog(live, StallReporter(recorder, metrics), record=record)
    recorder.watch = watchdog.ensure_running      # started with the first operation
"""
