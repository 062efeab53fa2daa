"""The evidence of a death, written ahead by the process and reported by one that outlives it.

dcp-otel installs no signal handler: a process ends exactly as it would
without it. A process that dies (SIGTERM's default action, SIGKILL from the OOM
killer, NCCL's ``abort()``, a segfault) runs no code of ours as it dies, so
what its ending would have said is kept *before*:

* :mod:`~dcp_otel.spool.layout`: one directory per process under the spool
  (``DCP_OTEL_SPOOL_DIR``), and the bytes of its record;
* :mod:`~dcp_otel.spool.record`: the record, a file mapped into the process:
  the hot path stores each call's start and end there (a store into memory the
  kernel keeps after the process is gone), each operation's ids once;
* :mod:`~dcp_otel.spool.spans`: spans built but not yet confirmed exported;
* :mod:`~dcp_otel.spool.encoding`: a finished span as compact JSON, and back;
* :mod:`~dcp_otel.spool.reader`: a record read back, as the spans the process
  would have sent, with its own trace and span ids;
* :mod:`~dcp_otel.spool.offline`: a whole spool read as span files are (``dcp-otel report``);
* :mod:`~dcp_otel.spool.survivor`: a process that outlives another (the agent,
  a peer rank, the next generation, the parent of spawned ranks) claims its
  record, sends its spans, and marks it reported;
* :mod:`~dcp_otel.spool.delivery`: where those spans go (the survivor's tracer
  provider, else the ``OTEL_*`` environment's exporters);
* :mod:`~dcp_otel.spool.process`: one process's record, kept spans and survivor, put together.

``dcp-otel report <spool dir>`` reads a spool like span files, whoever reported it.
"""
