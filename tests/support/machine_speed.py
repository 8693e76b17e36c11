"""How fast this machine is right now, as CI prints it beside the tests' time.

The tests' wall time is CPU bound on CI's 2 cores, and the same commit's tests took 380 s and 961 s there within an
hour (2026-12-05; mypy, before them, 19 s and 37 s): the virtual machine's host lends it more or less of its cores,
and no steal time shows inside the guest. Four probes, each on a CPU clock (so the run's other processes do not
count against it; a host that slows the core does), from the cheapest to the one most like the tests' own work:

* ``loop``: a tight pure-Python loop whose data fits in the first-level cache (milliseconds per million turns);
* ``fault``: touching fresh anonymous memory, microseconds per page fault (a virtual machine's costliest kernel path,
  which every process start and import takes thousands of times);
* ``start``: ``python -c pass`` in a child process, its CPU in milliseconds;
* ``import``: a fresh interpreter importing SQLAlchemy's ORM and pydantic, milliseconds of its CPU.

``python -m tests.support.machine_speed``: one sample, the four figures in that order.
``python -m tests.support.machine_speed summary FILE``: the samples in FILE (one per line) as medians and ranges.
"""

from __future__ import annotations

import mmap
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_IMPORT = ("import time; t = time.process_time(); import sqlalchemy.orm, pydantic; "
           "print(round((time.process_time() - t) * 1000))")


def _loop(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i % 7
    return s


def loop_ms(rounds: int = 3, n: int = 1_000_000) -> float:
    """CPU milliseconds per ``n`` loop iterations, the best of ``rounds`` (the least disturbed)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        _loop(n)
        best = min(best, time.process_time() - t0)
    return best * 1000


def fault_us(pages: int = 8192) -> float:
    """CPU microseconds per page fault on fresh anonymous memory (the best of three rounds)."""
    best = float("inf")
    for _ in range(3):
        mem = mmap.mmap(-1, pages * mmap.PAGESIZE)
        t0 = time.process_time()
        for off in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
            mem[off] = 1
        best = min(best, time.process_time() - t0)
        mem.close()
    return best / pages * 1e6


def start_ms(rounds: int = 3) -> float:
    """CPU milliseconds of ``python -c pass`` in a child process (the least of ``rounds``)."""
    best = float("inf")
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=120)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return best * 1000


def import_ms() -> float:
    """CPU milliseconds a fresh interpreter spends importing SQLAlchemy's ORM and pydantic (from cached bytecode)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip())


_NAMES = ("loop", "fault", "start", "import")
_UNITS = ("ms", "us", "ms", "ms")


def summary(path: Path) -> str:
    """The samples in ``path`` as one line: each probe's median and range."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    rows = [[float(v) for v in line.split()] for line in text.splitlines() if len(line.split()) == len(_NAMES)]
    if not rows:
        return "no samples"
    parts = []
    for i, (name, unit) in enumerate(zip(_NAMES, _UNITS, strict=True)):
        col = [r[i] for r in rows]
        digits = 1 if unit == "us" else 0
        parts.append(f"{name} {statistics.median(col):.{digits}f} {unit} ({min(col):.{digits}f}-{max(col):.{digits}f})")
    return f"{len(rows)} samples, CPU per probe: " + ", ".join(parts) + " (tests/support/machine_speed.py; higher is slower)"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "summary":
        print(summary(Path(sys.argv[2])))
    else:
        print(f"{loop_ms():.0f} {fault_us():.2f} {start_ms():.0f} {import_ms():.0f}")
