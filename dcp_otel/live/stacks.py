"""The Python stack of a thread inside a DCP call, read from another thread without stopping it.

``sys._current_frames()`` gives each thread's innermost frame. A thread blocked
in C++ (a gloo or NCCL wait) still has the Python frame that called into it, so
a rank waiting for another in one of DCP's collectives shows which one:
:func:`collective` finds the first ``torch.distributed`` collective on the
stack (``gather_object``, ``broadcast_object_list``, ``barrier``, ...) and the
DCP method that called it (``_DistWrapper.all_reduce``: DCP's "write" phase).
Only code objects and line numbers are read, never a frame's locals.

Usage::

    found = thread_stack(thread_id)
    if found is not None:
        print(found.text)                 # "Traceback"-style, outermost first
        print(found.top(3))               # "write_data (train.py:40) < save (...) < ..."
        print(found.collective)           # ("gather_object", "_DistWrapper.all_reduce") or None
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Final

#: Innermost frames kept of a stack (a training loop's outer frames say little).
MAX_FRAMES: Final = 48
#: The module torch.distributed's collectives live in; and DCP's own code.
_C10D_FILE: Final = "distributed_c10d.py"
_DCP_DIR: Final = "/distributed/checkpoint/"
_DIST_WRAPPER: Final = "_DistWrapper."
_STDLIB: Final = sysconfig.get_paths()["stdlib"] + os.sep
#: dcp-otel's own frames (its wrappers around DCP's collectives) are left out: they say nothing to the reader.
_OWN_DIR: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class ThreadStack:
    """One thread's stack at one moment."""

    thread_id: int
    thread_name: str
    text: str  # formatted like a traceback: outermost first, at most MAX_FRAMES frames
    frames: tuple[tuple[str, str, int], ...]  # (function, file, line), innermost first
    collective: tuple[str, str | None] | None  # (the collective, the DCP method that called it)

    def top(self, count: int = 3) -> str:
        """The innermost ``count`` frames outside Python's standard library (``threading``'s waits, say),
        on one line: ``write_data (writer.py:40) < save (...)``."""
        frames = [f for f in self.frames if not f[1].startswith(_STDLIB)] or list(self.frames)
        return " < ".join(f"{name} ({file.rsplit('/', 1)[-1]}:{line})" for name, file, line in frames[:count])


def thread_stack(thread_id: int, frame: FrameType | None = None) -> ThreadStack | None:
    """The stack of thread ``thread_id`` now (``frame``: its innermost frame, when known better, say the one a
    signal handler interrupted), or ``None`` if it has ended."""
    frame = frame if frame is not None else sys._current_frames().get(thread_id)
    if frame is None:
        return None
    names = {t.ident: t.name for t in threading.enumerate()}
    summary = traceback.StackSummary.from_list(
        [f for f in traceback.extract_stack(frame, limit=MAX_FRAMES) if not f.filename.startswith(_OWN_DIR)]
    )
    text = "Stack (most recent call last):\n" + "".join(summary.format())
    frames = tuple((f.name, f.filename, f.lineno or 0) for f in reversed(summary))
    return ThreadStack(thread_id, names.get(thread_id, f"thread-{thread_id}"), text, frames, collective(frame))


def collective(frame: FrameType | None) -> tuple[str, str | None] | None:
    """The torch.distributed collective ``frame``'s thread is in (the outermost such frame), and the
    DCP method that called it, if any."""
    codes: list[CodeType] = []
    while frame is not None:  # innermost first
        codes.append(frame.f_code)
        frame = frame.f_back
    codes.reverse()  # outermost first
    for index, code in enumerate(codes):
        if code.co_filename.endswith(_C10D_FILE) and not code.co_name.startswith("_"):
            dcp = [_qualname(c) for c in codes[:index] if _DCP_DIR in c.co_filename.replace("\\", "/")]
            # DCP's phase (_DistWrapper.all_reduce: "write"), not the helper it calls (gather_object);
            # elsewhere (the _experimental barriers, the state-dict API) the DCP code nearest the collective.
            phase = next((name for name in dcp if name.startswith(_DIST_WRAPPER)), None)
            return code.co_name, phase or (dcp[-1] if dcp else None)
    return None


def _qualname(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+


def with_helpers(stack: ThreadStack, helpers: list[int]) -> ThreadStack:
    """``stack`` (a thread waiting for a pool's work: its futures), with the stacks of the pool's threads working
    for it after its own; their innermost frames (and collective) first, since that is where the time goes."""
    others = [found for found in (thread_stack(ident) for ident in helpers) if found is not None]
    if not others:
        return stack
    text = stack.text + "".join(f"\nWorking for it, thread {o.thread_name}:\n{o.text}" for o in others)
    frames = tuple(f for o in others for f in o.frames) + stack.frames
    collective = next((o.collective for o in others if o.collective is not None), stack.collective)
    return ThreadStack(stack.thread_id, stack.thread_name, text, frames, collective)
