"""Where dcp-otel attaches to torch, in the rank's process.

* :mod:`~dcp_otel.attach.patches`: the one table of attachment points, installed
  and removed as a whole, degrading with one warning on a torch that moved them;
* :mod:`~dcp_otel.attach.logger_tap`: the tap standing in for DCP's logger;
* :mod:`~dcp_otel.attach.unlogged_calls`: DCP functions torch does not log (the
  state-dict API, safetensors consolidation) made DCP calls;
* :mod:`~dcp_otel.attach.checkpointer`: torch's ``_experimental`` checkpointer,
  and the rank's side of its checkpoint process;
* :mod:`~dcp_otel.attach.async_thread`: the context into the async save thread;
* :mod:`~dcp_otel.attach.async_process`: the rank's side of the async save daemon.

What runs in those other processes is in :mod:`dcp_otel.processes`, referred to
here by name only (its entry points are resolved in the child), so nothing in
this package imports it back.
"""
