"""How fast this machine is right now, as CI prints it beside the tests' time.

The tests' wall time is CPU bound on CI's 2 cores, and the same commit's tests took 380 s and 961 s there within an
hour (2026-12-05): the virtual machine's host lends it more or less of its cores and caches, and no steal time shows
inside the guest. Two probes, each on its own CPU clock (so the run's other processes do not count against it; a
host that slows the core does):

* ``loop``: a tight pure-Python loop (its data fits in the first-level cache): the core's own speed;
* ``import``: a fresh interpreter importing SQLAlchemy and pydantic, what most of the tests' child processes and
  workers spend their CPU on (unmarshalling code, allocating): the one that moved with the tests' time (a quiet
  machine's import took 0.35-0.75 CPU s while the loop stayed at 67-82 ms).

``python -m tests.support.machine_speed``: one sample, ``LOOP_MS IMPORT_MS``.
``python -m tests.support.machine_speed summary FILE``: the samples in FILE (one per line) as medians and ranges.
"""

from __future__ import annotations

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


def import_ms() -> float:
    """CPU milliseconds a fresh interpreter spends importing SQLAlchemy's ORM and pydantic (from cached bytecode)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip())


def summary(path: Path) -> str:
    """The samples in ``path`` as one line: each probe's median and range."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    rows = [line.split() for line in text.splitlines() if len(line.split()) == 2]
    if not rows:
        return "no samples"
    loops, imports = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    return (f"{len(rows)} samples: loop {statistics.median(loops):.0f} ms CPU ({min(loops):.0f}-{max(loops):.0f}), "
            f"import {statistics.median(imports):.0f} ms CPU ({min(imports):.0f}-{max(imports):.0f}); "
            "the higher, the slower the host lent the cores (tests/support/machine_speed.py)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "summary":
        print(summary(Path(sys.argv[2])))
    else:
        print(f"{loop_ms():.0f} {import_ms():.0f}")
