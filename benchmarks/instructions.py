"""The caller's bill of a real save in instructions: what dcp-otel adds, counted by valgrind, not timed.

    .venv/bin/python benchmarks/instructions.py [--saves 20] [--spans 200]    # ~1 min on 2 cores

Needs valgrind (``apt-get install -y valgrind``; ``scripts/setup.sh --valgrind`` installs it).

``fixed_cost.py`` times the bill; on a shared 2-core machine its cycles spread over 3x, so a change of a
tenth of the bill hides in the noise. Here callgrind counts, instead of timing, what the training thread
executes in the same save (a one-tensor state dict, a gloo world of one, /dev/shm), each arm in a process
of its own under valgrind:

* plain: torch alone (``uninstrument()``'s state), its own logging included;
* traced: ``instrument(detail="full")``, the finished operations held back from the builder, as in
  ``fixed_cost.py``'s "own" arm: only what the training thread itself runs;
* plain and traced again with the garbage collector off: its share of the difference (collections
  that the objects a save leaves for the builder bring on);
* bare spans: the unit of the bill, the bare SDK span ``fixed_cost.py`` times (``start_span`` with four
  attributes, made current, detached, ended), here counted.

Only the measured region counts: callgrind collects inside libc's ``qsort`` (``--toggle-collect``), and
the region runs as its comparison callback (through ``ctypes``), after warm-up saves outside it and a
full collection. callgrind instruments nothing until the warm-up is done (a client request starts it;
one more round then runs instrumented but outside the count, so its cache model starts warm): torch's
import alone takes ~40 s under full instrumentation, an arm now ~15 s (on x86-64, where the request's
machine code can run; elsewhere callgrind instruments from the start: slower, the same counts).
Counts repeat to within 0.2 % from run to run (thread scheduling and the garbage collector's timing).
One region per process: ``--dump-after`` does not separate regions here (glibc's ``qsort`` jumps into
``qsort_r``, which other code may call too).

Printed: instructions (Ir) per save, plain and traced, and the difference in bare spans' worth of
instructions; then the level-1 cache misses of callgrind's cache model (I1: code, D1: data; the host's
cache sizes) per save and per bare span. Instructions are the work; misses are why the same work costs
more amid a save than in a loop: a bare span timed in a loop finds its code and data in cache, dcp-otel's
hooks (and a bare span made amid saves) find them evicted by torch's save. ``fixed_cost.py`` prints both
time units; this prints the work and the misses behind them.

What it leaves out: the kernel (a save's file I/O: plain's and traced's alike), waits, other threads
(the builder: ``fixed_cost.py`` reports its CPU), and real cycles (callgrind does not simulate timing).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import functools
import gc
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: callgrind's events with its cache model, in the order its output files list them.
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
#: (arm, whether the garbage collector runs); "bare" runs bare spans, the others saves.
ARMS = (("plain", True), ("traced", True), ("plain", False), ("traced", False), ("bare", True))
_WARM = 10  # past CPython 3.11's 8 calls before a function is specialized (quickened): none of that in the region

#: valgrind's client request on x86-64 (``VALGRIND_DO_CLIENT_REQUEST_EXPR`` in valgrind.h) as a function of
#: one argument, the request's six words: rax = the words, rdx = 0 (what runs natively returns), the four
#: rotations of rdi (128 bits: a no-op natively) that tell valgrind a request follows, ``xchg rbx, rbx``,
#: return rdx.
_CLIENT_REQUEST = bytes.fromhex("4889f8" "4831d2" "48c1c703" "48c1c70d" "48c1c73d" "48c1c733" "4887db" "4889d0" "c3")
_RUNNING_ON_VALGRIND = 0x1001
_START_INSTRUMENTATION = 0x43540004  # VG_USERREQ_TOOL_BASE('C', 'T') + 4, callgrind.h


def _client_request(request: int) -> int:
    """Send valgrind a client request without a C compiler: the request's machine code, run through ctypes."""
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(_CLIENT_REQUEST)
    call = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    words = (ctypes.c_size_t * 6)(request)
    return int(call(ctypes.addressof(words)))


def _sends_requests() -> bool:
    """Whether this machine can run :func:`_client_request`: x86-64, and memory it may write and execute
    (a hardened kernel may refuse it). Outside valgrind the request returns 0."""
    if platform.machine() != "x86_64":
        return False
    try:
        return _client_request(_RUNNING_ON_VALGRIND) == 0
    except (OSError, ValueError):
        return False


def _start_instrumentation() -> None:
    """Have callgrind instrument from here on (it was started with ``--instr-atstart=no``): torch's import
    and the warm-up ran uninstrumented, about 4x faster."""
    if _client_request(_RUNNING_ON_VALGRIND) != 1:
        raise RuntimeError("valgrind did not answer its client request: this arm's counts would be empty")
    _client_request(_START_INSTRUMENTATION)


def _in_region(run: Callable[[], None]) -> None:
    """Run ``run`` as the comparison callback of libc's qsort: the only code callgrind counts."""
    libc = ctypes.CDLL(None)
    compare_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    ran = [False]

    def compare(a: int, b: int) -> int:
        if not ran[0]:  # two items: one comparison, but never run twice
            ran[0] = True
            run()
        return 0

    items = (ctypes.c_int * 2)(1, 2)
    libc.qsort(items, 2, ctypes.sizeof(ctypes.c_int), compare_type(compare))


def child(arm: str, count: int, collector: bool, requests: bool) -> None:
    """One arm, in a process under callgrind: warm up, then ``count`` saves (or bare spans) in the region.

    ``requests``: callgrind waits for :func:`_start_instrumentation` (else it instrumented from the start).
    """
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from fixed_cost import _bare_span_cpu_ns, gloo_world_of_one
    from prometheus_client import CollectorRegistry

    import dcp_otel

    state = {"w": torch.zeros(16)}
    root = tempfile.mkdtemp(dir="/dev/shm")  # (the store's file too: os._exit below leaves no context manager)
    with gloo_world_of_one(store=os.path.join(root, "store")) as (provider, _):
        if arm == "bare":
            tracer = provider.get_tracer("bench")
            _bare_span_cpu_ns(tracer, 50)
            region: Callable[[], None] = lambda: _bare_span_cpu_ns(tracer, count)  # noqa: E731
        else:
            if arm == "traced":
                dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), detail="full")
                held: list[object] = []
                # As fixed_cost.py's "own" arm: the builder gets nothing while the region runs.
                dcp_otel.DCPInstrumentor().recorder.builder.submit = lambda op, calls=None: held.append(op)

            def saves(n: int) -> None:
                for i in range(n):
                    dcp.save(state, checkpoint_id=os.path.join(root, f"c{i % 4}"))

            saves(_WARM)
            region = functools.partial(saves, count)
        if requests:
            _start_instrumentation()
        # One more round instrumented but not counted, so callgrind's cache model starts warm as the region.
        region() if arm == "bare" else saves(1)
        gc.collect()
        if not collector:
            gc.disable()
        _in_region(region)
        sys.stdout.flush()
        shutil.rmtree(root, ignore_errors=True)  # the checkpoints and the store's file: nothing left in /dev/shm
        os._exit(0)  # the region is counted; tearing down the process group is not worth valgrind's time


def counted(arm: str, count: int, collector: bool, workdir: str, requests: bool) -> dict[str, int]:
    """callgrind's totals for one arm, run in a process of its own."""
    out = os.path.join(workdir, f"callgrind.{arm}.{int(collector)}")
    instr = "no" if requests else "yes"
    command = ["valgrind", "--tool=callgrind", f"--instr-atstart={instr}", "--collect-atstart=no", "--toggle-collect=*qsort*", "--cache-sim=yes",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--child", arm, str(count),
               "1" if collector else "0", "1" if requests else "0"]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in every run
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"valgrind failed for the {arm} arm: {done.stderr[-2000:]}")
    text = Path(out).read_text()
    events = re.search(r"^events: (.+)$", text, re.M)
    totals = re.search(r"^(?:totals|summary): (.+)$", text, re.M)
    if events is None or totals is None:
        raise RuntimeError(f"no totals in {out}")
    return dict(zip(events.group(1).split(), (int(v) for v in totals.group(1).split()), strict=False))


def measure(saves: int = 20, spans: int = 200) -> dict[str, float]:
    """callgrind's counts per save (per bare span for ``bare``), in valgrind processes two at a time.

    Keys: ``ir_<arm>``, ``i1_<arm>``, ``d1_<arm>`` (instructions, L1 code and data misses) for ``plain``,
    ``traced``, ``bare``, and with ``_nogc`` for the first two with the garbage collector off; ``added``
    (instructions per save), ``spans`` (that in bare spans), ``collector_share`` (of ``added``, the part
    gone with the collector off), ``misses_per_k`` and ``bare_misses_per_k`` (L1 misses per 1,000
    instructions, added per save and of a bare span).
    """
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: apt-get install -y valgrind (or scripts/setup.sh --valgrind)")
    requests = _sends_requests()
    with tempfile.TemporaryDirectory(prefix="dcp-otel-callgrind-") as workdir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # fmt: skip
        jobs = {(arm, collector): pool.submit(counted, arm, spans if arm == "bare" else saves, collector, workdir,
                                              requests)
                for arm, collector in ARMS}  # fmt: skip
        totals = {key: job.result() for key, job in jobs.items()}
    found: dict[str, float] = {}
    for (arm, collector), events in totals.items():
        per = spans if arm == "bare" else saves
        suffix = "" if collector else "_nogc"
        found[f"ir_{arm}{suffix}"] = events["Ir"] / per
        found[f"i1_{arm}{suffix}"] = events.get("I1mr", 0) / per
        found[f"d1_{arm}{suffix}"] = (events.get("D1mr", 0) + events.get("D1mw", 0)) / per
    found["added"] = found["ir_traced"] - found["ir_plain"]
    found["spans"] = found["added"] / found["ir_bare"]
    found["collector_share"] = 1 - (found["ir_traced_nogc"] - found["ir_plain_nogc"]) / found["added"]
    found["misses_per_k"] = 1000 * (found["i1_traced"] + found["d1_traced"] - found["i1_plain"] - found["d1_plain"]) \
        / found["added"]  # fmt: skip
    found["bare_misses_per_k"] = 1000 * (found["i1_bare"] + found["d1_bare"]) / found["ir_bare"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--spans", type=int, default=200)
    parser.add_argument("--child", nargs=4, metavar=("ARM", "COUNT", "COLLECTOR", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2] == "1", args.child[3] == "1")
        return
    import torch

    f = measure(args.saves, args.spans)
    print(f"the caller's bill of a real save in instructions, 1 gloo rank (torch {torch.__version__}; callgrind, "
          f"{args.saves} saves and {args.spans} bare spans per arm)")  # fmt: skip
    print(f"  instructions per save, plain / traced            {f['ir_plain']:12,.0f} / {f['ir_traced']:,.0f}")
    print(f"  added per save                                   {f['added']:12,.0f} = {f['spans']:.2f} bare spans of "
          f"{f['ir_bare']:,.0f}")  # fmt: skip
    print(f"    of which the garbage collector                 {f['collector_share']:12.2f} "
          f"(with it off: {f['ir_traced_nogc'] - f['ir_plain_nogc']:,.0f} added)")  # fmt: skip
    added_i1, added_d1 = f["i1_traced"] - f["i1_plain"], f["d1_traced"] - f["d1_plain"]
    print(f"  L1 misses added per save, code / data            {added_i1:12,.0f} / {added_d1:,.0f} "
          f"(a bare span in a loop: {f['i1_bare']:,.0f} / {f['d1_bare']:,.0f})")  # fmt: skip
    print(f"  L1 misses per 1,000 added instructions           {f['misses_per_k']:12.1f} "
          f"(a bare span in a loop: {f['bare_misses_per_k']:.1f}; "
          f"a plain save: {1000 * (f['i1_plain'] + f['d1_plain']) / f['ir_plain']:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
