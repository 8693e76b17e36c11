"""CPU seconds per test, for finding what makes the suite slow on a loaded 2-core machine.

Wall-clock durations there measure the neighbours as much as the test; CPU seconds (this process's and its
reaped children's: the gateways, upstreams and workers a test starts and stops) do not. Enable with
``UNDOLOG_TEST_CPU_REPORT=DIR``: each process (each xdist worker) appends ``nodeid<TAB>cpu_seconds`` lines to
``DIR/cpu-<pid>.tsv``; ``python -m tests.support.cpu_report DIR`` sums them by test and by module.
"""

from __future__ import annotations

import os
import resource
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CpuReport:
    """The pytest plugin: one line per test (set-up, call and tear-down together)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.out = (folder / f"cpu-{os.getpid()}.tsv").open("a", encoding="utf-8")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Iterator[None]:
        start = _cpu()
        yield
        self.out.write(f"{item.nodeid}\t{_cpu() - start:.3f}\n")
        self.out.flush()


def summarize(folder: Path, top: int = 40) -> str:
    """The tests and modules that cost the most CPU seconds, with the total."""
    by_test: Counter[str] = Counter()
    for f in folder.glob("cpu-*.tsv"):
        for line in f.read_text(encoding="utf-8").splitlines():
            nodeid, _, secs = line.rpartition("\t")
            by_test[nodeid] += float(secs)
    by_module: Counter[str] = Counter()
    for nodeid, secs in by_test.items():
        by_module[nodeid.split("::")[0]] += secs
    lines = [f"{sum(by_test.values()):.0f} CPU s in {len(by_test)} tests", "", "by module:"]
    lines += [f"  {s:7.1f}  {m}" for m, s in by_module.most_common(top)]
    lines += ["", "by test:"]
    lines += [f"  {s:7.1f}  {t}" for t, s in by_test.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40))
