"""Longest tests first: the order that keeps a step from ending on one long test started last.

A step's tests run in pytest-randomly's random order; a 50 s test that happens to start near the end makes the
step's critical path 50 s longer while the other workers sit idle. ``tests/data/durations.json`` names the tests
that took long in CI (seconds, per database); :func:`order_longest_first` moves them to the front. Every other test
keeps the random order (the suite must pass in random order), after them.

Under ``--dist worksteal`` (what ``.ci/run`` uses) xdist hands each worker one contiguous slice of the order at the
start, and an idle worker steals from the *tail* of a busy worker's queue. So the long tests are dealt over the
slices, longest first onto the least loaded slice, each slice starting with its own: every worker begins with its
share of long tests and the short tests behind them are what gets stolen. Without xdist, or under ``--dist load``
(which deals the order out round robin), the long tests simply go first.

Regenerate the file from a CI run's JUnit reports (``.ci/run`` writes them to ``artifacts/``)::

    .venv/bin/python -m tests.support.durations artifacts/junit-sqlite-default.xml \\
        artifacts/junit-sqlite-adapters.xml artifacts/junit-postgres-default.xml artifacts/junit-postgres-adapters.xml
"""

from __future__ import annotations

import heapq
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
DURATIONS_FILE = ROOT / "tests" / "data" / "durations.json"
#: Tests shorter than this (seconds) stay in the random order: only the tail-makers are worth a fixed place.
LONG_SECONDS = 5.0

T = TypeVar("T")


def load(backend: str, path: Path = DURATIONS_FILE) -> dict[str, float]:
    """The known long tests' seconds on one database (``sqlite`` or ``postgres``); empty when the file is missing."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.get(backend, {}).items()}


def worksteal_slices(n: int, workers: int) -> list[int]:
    """The sizes of the slices xdist's worksteal scheduler hands its workers at the start (``check_schedule``)."""
    sizes = []
    remaining = n
    for i in range(workers):
        size = remaining // (workers - i)
        sizes.append(size)
        remaining -= size
    return sizes


def order_longest_first(items: Sequence[T], seconds: dict[str, float], nodeid: Any, workers: int = 0,
                        dist: str = "no") -> list[T]:
    """Items reordered so the known long ones start first; the rest keep their order, after them.

    Args:
        items: The collected items, in the run's (random) order.
        seconds: Known seconds by node id (:func:`load`).
        nodeid: How to get an item's node id (``lambda item: item.nodeid``).
        workers: The xdist worker count (0: no xdist).
        dist: The xdist ``--dist`` mode.

    Example:
        >>> order_longest_first(["a", "b", "c"], {"c": 40.0}, str)
        ['c', 'a', 'b']
    """
    long_ones = sorted(((seconds[nodeid(i)], k, i) for k, i in enumerate(items)
                        if seconds.get(nodeid(i), 0.0) >= LONG_SECONDS), key=lambda t: (-t[0], t[1]))
    if not long_ones:
        return list(items)
    taken = {k for _, k, _ in long_ones}
    rest = [i for k, i in enumerate(items) if k not in taken]
    if workers <= 1 or dist != "worksteal":
        return [i for _, _, i in long_ones] + rest
    sizes = worksteal_slices(len(items), workers)
    heads: list[list[T]] = [[] for _ in sizes]
    # Least loaded slice first (ties: the lower slice), never more long tests than a slice holds.
    loads = [(0.0, s) for s in range(len(sizes))]
    for secs, _, item in long_ones:
        skipped = []
        while True:
            load_s, s = heapq.heappop(loads)
            if len(heads[s]) < sizes[s]:
                break
            skipped.append((load_s, s))
        heads[s].append(item)
        heapq.heappush(loads, (load_s + secs, s))
        for entry in skipped:
            heapq.heappush(loads, entry)
    ordered: list[T] = []
    fill = iter(rest)
    for s, size in enumerate(sizes):
        ordered += heads[s]
        ordered += [next(fill) for _ in range(size - len(heads[s]))]
    ordered += list(fill)
    return ordered


def _nodeid(classname: str, name: str) -> str:
    """A JUnit testcase's pytest node id (``tests.mcp.test_x.TestY`` + ``test_z[p]``)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def from_junit(reports: Sequence[Path]) -> dict[str, dict[str, float]]:
    """Long tests' seconds per database from ``junit-<db>-<step>.xml`` reports (the longest seen wins)."""
    found: dict[str, dict[str, float]] = {"sqlite": {}, "postgres": {}}
    for report in reports:
        backend = report.name.removeprefix("junit-").split("-", 1)[0]
        if backend not in found:
            raise SystemExit(f"{report}: name it junit-sqlite-*.xml or junit-postgres-*.xml (as .ci/run does)")
        for case in ET.parse(report).getroot().iter("testcase"):
            secs = float(case.get("time", "0") or 0)
            nodeid = _nodeid(case.get("classname", ""), case.get("name", ""))
            if secs >= LONG_SECONDS:
                found[backend][nodeid] = round(max(secs, found[backend].get(nodeid, 0.0)), 1)
    return {b: dict(sorted(d.items(), key=lambda kv: -kv[1])) for b, d in found.items()}


def main(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tests.support.durations artifacts/junit-sqlite-default.xml ...")
    data = {"about": "Seconds of the tests that took 5 s or more in CI, per database; read by tests/conftest.py "
                     "to start them first. Regenerate: python -m tests.support.durations artifacts/junit-*.xml",
            **from_junit([Path(a) for a in argv])}
    DURATIONS_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{DURATIONS_FILE.relative_to(ROOT)}: " + ", ".join(f"{b} {len(data[b])} tests" for b in ("sqlite", "postgres")))


if __name__ == "__main__":
    main(sys.argv[1:])
