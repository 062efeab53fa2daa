"""What runs in the processes torch starts for a rank: the async save daemon and the checkpoint process.

* :mod:`~dcp_otel.processes.daemon`: the daemon's entry point, its tracer
  provider, its saves in the rank's context, its flushes;
* :mod:`~dcp_otel.processes.checkpoint_process`: the ``_experimental``
  checkpointer's checkpoint process, traced after the user's ``subprocess_init_fn``;
* :mod:`~dcp_otel.processes.writer_process`: ``torch_checkpointing``'s writer process, the same way.

The rank's side (:mod:`dcp_otel.attach`) names these entry points in strings
(:data:`DAEMON_MAIN`, :data:`CHECKPOINT_PROCESS_MAIN`, :data:`WRITER_PROCESS_MAIN`); they are imported in the
child process, never by the rank's modules.
"""

#: ``module:function`` of the async save daemon's entry point (see :mod:`dcp_otel.processes.daemon`).
DAEMON_MAIN = "dcp_otel.processes.daemon:daemon_main"
#: ``module:function`` of the checkpoint process's entry point.
CHECKPOINT_PROCESS_MAIN = "dcp_otel.processes.checkpoint_process:checkpoint_process_main"
#: ``module:function`` of ``torch_checkpointing``'s writer process's entry point.
WRITER_PROCESS_MAIN = "dcp_otel.processes.writer_process:writer_process_main"
