"""The shape of a process's record: where it lives, how its directory is named, and its bytes.

One directory per instrumented process under the spool directory, named
``<host>.<pid>.<start>`` (``host``: its name and pid namespace, :func:`host_name`;
``start``: the process's start time in clock ticks since boot, from
``/proc/<pid>/stat``, so a reused pid never passes for the dead process). It holds:

* ``record``: a file of :data:`RECORD_SIZE` bytes, mapped into the process
  (``mmap``, ``MAP_SHARED``): what the process writes there is in the page
  cache at once and survives any death of the process, SIGKILL included;
* ``spans.jsonl``: the spans the builder made that no exporter has confirmed
  yet, a line per operation (:mod:`dcp_otel.spool.spans`); a line whose scope
  ends with :data:`NODE_LINE` was written for the node to send, given to no
  exporter of the process's own;
* once a survivor has taken it, ``death.json``: how it died, when, who reported it.

A survivor renames the directory to claim it (``.claimed.<pid>.<start>``,
atomic: one survivor wins) and again once it has reported it (``.reported``).
A survivor says it runs with an empty file ``<host>.<pid>.<start>.survivor``:
the deaths of its children are its to report (it knows how they died).

The record's bytes::

    [0, 4096)        header: magic, times, the recovery point, the training step, the identity (JSON)
    [4096, 135168)   64 operation slots of 2 KiB: ids, state, the async upload and staging, attributes (a Python
                     literal),
                     how it ended (once it did)
    [135168, 266240) 32 threads x 32 entries of 128 B: each thread's last 32 calls, a ring (open: no end yet)
    [266240, 299008) stall stacks (JSON, with a CRC)

Usage::

    name = directory_name(host, pid, start)      # "node-3.4242.81234"
    parse_name("node-3.4242.81234.reported")     # -> ("node-3", 4242, 81234, "reported")
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import struct
from typing import Final, NamedTuple

from dcp_otel import semconv

MAGIC: Final = b"DCPOTEL1"
#: The layout's version: a record of another is not read (its offsets are not these).
VERSION: Final = 4

# --- the header -------------------------------------------------------------------------
HEADER_SIZE: Final = 4096
#: magic, version, created_ns, heartbeat_ns, recovery_end_ns, training_step (-1: none), exported_through,
#: process span id, flags, exited_ns
HEADER: Final = struct.Struct("<8sQqqqqQQQq")
OFF_CREATED: Final = 16
OFF_HEARTBEAT: Final = 24
OFF_RECOVERY: Final = 32
OFF_STEP: Final = 40
OFF_EXPORTED: Final = 48
OFF_FLAGS: Final = 64
OFF_EXITED: Final = 72
OFF_RECOVERY_ID: Final = 128  # 128 bytes of the last durable checkpoint id (UTF-8, NUL padded)
RECOVERY_ID_SIZE: Final = 128
OFF_IDENTITY: Final = 256  # u32 length, then the identity JSON
IDENTITY_MAX: Final = HEADER_SIZE - OFF_IDENTITY - 4
FLAG_EXITED: Final = 1  # the process reached its exit flush: what is open was ended by the process itself
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
U16 = struct.Struct("<H")

# --- operations ---------------------------------------------------------------------------
OPS_OFFSET: Final = HEADER_SIZE
OP_SLOTS: Final = 64
OP_SIZE: Final = 2048
#: serial (0: never used), state, the operation's end (once complete), upload span id, upload start, upload end,
#: staging span id, staging start, staging end, the length of the literal that follows (ids, attributes)
OP_HEAD: Final = struct.Struct("<QQqQqqQqqI")
#: An operation's state: open (its calls run), complete (ended, not yet built: its ends and outcome are here),
#: done (built and kept: :mod:`~dcp_otel.spool.spans` has its spans).
OP_STATE_OPEN, OP_STATE_DONE, OP_STATE_COMPLETE = 1, 2, 3
OFF_OP_STATE: Final = 8
#: Written as an operation completes, in one store: its state, and its end.
COMPLETE: Final = struct.Struct("<Qq")
OFF_OP_UPLOAD: Final = 24  # span id, start, end
OFF_OP_STAGING: Final = 48
OFF_OP_JSON: Final = OP_HEAD.size
OFF_OP_FAILED: Final = OP_SIZE - 256  # how it failed (UTF-8, NUL padded): written as it completes
OP_FAILED_MAX: Final = 256
FAILED: Final = struct.Struct("<256s")
OP_JSON_MAX: Final = OFF_OP_FAILED - OFF_OP_JSON
UPLOAD: Final = struct.Struct("<Qqq")

# --- calls on threads ---------------------------------------------------------------------
THREADS_OFFSET: Final = OPS_OFFSET + OP_SLOTS * OP_SIZE
THREAD_SLOTS: Final = 32
#: Each thread's calls go round a ring of this many entries: a call open at a death is among the thread's
#: latest (its callers opened before it: the operation's own span comes from its operation slot).
RING: Final = 32
RING_MASK: Final = RING - 1
ENTRY_SHIFT: Final = 7  # 128-byte entries: the n-th call of a thread is at base + ((n & RING_MASK) << ENTRY_SHIFT)
ENTRY_SIZE: Final = 1 << ENTRY_SHIFT
THREAD_SIZE: Final = RING * ENTRY_SIZE
#: span id, start, end (0: open), the operation's serial, kind, name (UTF-8, NUL padded: struct cuts a longer
#: one; a collective's says whom it serves: "gather_object|all_reduce|write"). Its parent is the call it nests in
#: on its thread (calls nest strictly within a thread), read back from the starts and ends.
ENTRY: Final = struct.Struct("<QqqQB95s")
OFF_ENTRY_END: Final = 16
#: The kinds of call an entry holds (records.KIND_* as one byte).
KIND_CODES: Final = {"operation": 1, "step": 2, "collective": 3}
KINDS: Final = {code: kind for kind, code in KIND_CODES.items()}

# --- stall stacks -------------------------------------------------------------------------
STACKS_OFFSET: Final = THREADS_OFFSET + THREAD_SLOTS * THREAD_SIZE
STACKS_SIZE: Final = 32 * 1024
STACK_HEAD: Final = struct.Struct("<II")  # length, CRC-32 of the JSON that follows
RECORD_SIZE: Final = STACKS_OFFSET + STACKS_SIZE

# --- files and names ----------------------------------------------------------------------
RECORD_FILE: Final = "record"
SPANS_FILE: Final = "spans.jsonl"
NODE_LINE: Final = "node"  # a spans.jsonl line's scope says so (``[name, version, "node"]``): written for the node to send
DEATH_FILE: Final = "death.json"
CLAIMED: Final = "claimed"
REPORTED: Final = "reported"
SURVIVOR: Final = "survivor"  # an empty file: a process that reports its children's deaths runs (see spool.survivor)
_NAME = re.compile(r"^(?P<host>[^.]+)\.(?P<pid>\d+)\.(?P<start>\d+)(?:\.(?P<state>claimed\.\d+\.\d+|reported|survivor))?$")


class RecordName(NamedTuple):
    host: str
    pid: int
    start: int
    state: str  # "" (the process's own), "claimed.<pid>.<start>", "reported"

    @property
    def base(self) -> str:
        return directory_name(self.host, self.pid, self.start)


def directory_name(host: str, pid: int, start: int) -> str:
    return f"{host}.{pid}.{start}"


def survivor_name(pid: int) -> str:
    """The file by which process ``pid`` of this host says it runs a survivor (``<host>.<pid>.<start>.survivor``)."""
    return f"{directory_name(host_name(), pid, start_ticks(pid) or 0)}.{SURVIVOR}"


@functools.lru_cache(maxsize=4096)  # (a survivor parses the spool's names every second: the same names)
def parse_name(name: str) -> RecordName | None:
    found = _NAME.match(name)
    if found is None:
        return None
    return RecordName(found["host"], int(found["pid"]), int(found["start"]), found["state"] or "")


def host_name() -> str:
    """This host's name and pid namespace, as record directories say it: ``node-3-4026531836`` (no dots or slashes
    of their own: they separate fields). A pid means a process only in its namespace: two containers sharing a
    spool (and a host name) never judge each other's records."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()) or "host"
    try:
        namespace = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))  # "pid:[4026531836]"
    except OSError:
        namespace = ""
    return f"{host}-{namespace}" if namespace else host


def _stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` from the third on (state first); empty when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return []
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    return text[text.rfind(b")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot; ``None`` when there is no such process."""
    fields = _stat(pid)
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def alive(pid: int, start: int) -> bool:
    """Whether the process that wrote a record still runs (a zombie has ended: only its status is left).

    Dead only on evidence: no such process, another one under its pid, or a zombie. A read that fails for another
    reason (too many open files) says nothing, and the process counts as alive: a survivor never reports a death,
    nor forgets a process as dead, on it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return fields[0] != b"Z" and int(fields[19]) == start
    except (IndexError, ValueError):
        return False


def exit_status_of_child(pid: int) -> int | None:
    """A child's exit status as ``Popen.returncode`` says it, read without reaping it (``None``: not a child,
    already reaped, or still running)."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError, AttributeError):
        return None
    if found is None:
        return None
    if found.si_code == os.CLD_EXITED:
        return found.si_status
    return -found.si_status


def other_survivors(spool_dir: str, names: list[str], host: str) -> set[int]:
    """The pids of the survivors other than this process's that run on ``host`` now, by their announcements among
    ``names`` (the listing of ``spool_dir``); a stale announcement is removed."""
    found: set[int] = set()
    for name in names:
        parsed = parse_name(name)
        if parsed is None or parsed.state != SURVIVOR or parsed.host != host or parsed.pid == os.getpid():
            continue
        if alive(parsed.pid, parsed.start):
            found.add(parsed.pid)
        else:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(spool_dir, name))
    return found


def mtime(path: str) -> float:
    """When ``path`` was last written (0: it is gone)."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


#: Where records are kept when ``DCP_OTEL_SPOOL_DIR`` is unset: a RAM file system when it is big enough
#: (nothing there ever waits for a disk), else the temporary directory.
_RAM_DIR: Final = "/dev/shm"
_RAM_MIN_BYTES: Final = 1 << 30
OFF_VALUES: Final = frozenset({"off", "none", "false", "0", "no"})


def default_spool_dir() -> str:
    """``/dev/shm/dcp-otel-<uid>`` where ``/dev/shm`` holds at least 1 GiB, else ``$TMPDIR/dcp-otel-<uid>``."""
    user = f"dcp-otel-{os.getuid()}" if hasattr(os, "getuid") else "dcp-otel"
    try:
        found = os.statvfs(_RAM_DIR)
        if found.f_blocks * found.f_frsize >= _RAM_MIN_BYTES and os.access(_RAM_DIR, os.W_OK):
            return os.path.join(_RAM_DIR, user)
    except OSError:
        pass
    import tempfile

    return os.path.join(tempfile.gettempdir(), user)


def spool_dir_from_env() -> str | None:
    """``$DCP_OTEL_SPOOL_DIR``, else the default; ``None`` when it says ``off``."""
    value = os.environ.get(semconv.ENV_SPOOL_DIR, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    return value or default_spool_dir()
