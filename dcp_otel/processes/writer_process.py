"""Tracing inside ``torch_checkpointing``'s writer process (the process side).

``torch_checkpointing``'s ``AsyncCheckpointSaver`` writes each checkpoint in a
process its ``CheckpointProcess`` spawns with ``CheckpointProcess._subprocess``
as entry point, the same design as torch's ``_experimental`` checkpointer with
two more arguments (``thread_name_prefix``, ``metric_prefix``).
:func:`writer_process_main` replaces that entry point (see
:mod:`dcp_otel.attach.torch_checkpointing` for the rank's side) and runs it as
:func:`~dcp_otel.processes.checkpoint_process.run_traced` runs the
checkpointer's: tracing set up right after the user's ``subprocess_init_fn``,
each write request in the context of the operation the rank sent with it (so
``dcp.write_checkpoint``, its items, barrier and rename are children of the
rank's ``dcp.async_upload``), its metrics sent back before torch_checkpointing
answers. A process started without a bootstrap runs the entry point untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dcp_otel.attach.torch_checkpointing import PROCESS_ENTRY, process_class
from dcp_otel.processes.checkpoint_process import run_traced

#: ``torch_checkpointing``'s own entry point, set when it is replaced in this process.
TORCH_ENTRY: Callable[..., None] | None = None


def writer_process_main(*args: Any) -> None:
    """The writer process's entry point: ``torch_checkpointing``'s, traced (see the module)."""
    entry = TORCH_ENTRY
    if entry is None:  # a spawned process: the class is torch_checkpointing's own here
        entry = vars(process_class())[PROCESS_ENTRY].__func__
    run_traced(entry, args)

