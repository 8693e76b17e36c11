"""The model-based fault harness: random sequences of calls, decisions, releases, rollbacks, recoveries, expiries
and resumes across forked processes, SIGKILLed at every named fault point, checked against the invariants after
every step (see ``model.py`` for the world and the invariants).

CI runs 300 sequences per database (``test_fault_harness``, in six parts of 50 that xdist spreads over its workers:
one part of 300 was the suite's longest test); ``pytest --long`` also runs 3,000 (``-m long``).
Replay: the failure message prints the seed of the failing sequence; ``UNDOLOG_HARNESS_SEQ=<seed>`` runs only
that one, ``UNDOLOG_HARNESS_SEED=<base>`` moves the whole range (sequence i has seed base + i), and
``UNDOLOG_HARNESS_N=<n>`` changes how many run. ``UNDOLOG_HARNESS_SURVEY=1`` runs every sequence even after a
failure and prints how many sequences broke which invariant (with each invariant's first, shrunk, sequence).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from undolog_core import UndoLog

from ..conftest import PG_URL, TEST_DB
from .model import Harness, Result, Step, shrink

CI_SEQUENCES = 300
#: The CI run is cut into this many tests of CI_SEQUENCES / CI_PARTS sequences each (seeds stay 0..299).
CI_PARTS = 6
LONG_SEQUENCES = 3000


@pytest.fixture
def fresh(tmp_path: Path, pg_admin: Any, db_templates: Any) -> Iterator[Callable[[], tuple[UndoLog, str, str | None]]]:
    """New, empty databases on demand: the harness's own, and one per replay while shrinking (a replay starts
    from nothing, like the failing run).

    Each is a copy of the session's migrated template (``tests/support/db_template.py``: what the migrations make,
    for a fraction of their CPU), as the ``db`` fixture's are.
    SQLite files go to /dev/shm when there is one: the harness kills processes, never the machine, so what a
    killed process wrote is in the page cache either way, and an fsync per commit would only cost time here.
    """
    opened: list[tuple[UndoLog, str | None]] = []
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="undolog-harness-", dir=shm)) if shm.is_dir() else tmp_path

    def make() -> tuple[UndoLog, str, str | None]:
        if TEST_DB == "postgres":
            schema = "h_" + uuid.uuid4().hex[:16]
            url = PG_URL
            db_templates.clone_to(schema, "core")
        else:
            schema = None
            path = folder / ("h-" + uuid.uuid4().hex[:8] + ".db")
            url = f"sqlite:///{path}"
            db_templates.copy_to(path, "core")
        u = UndoLog.open(url, schema=schema)
        opened.append((u, schema))
        return u, url, schema

    yield make
    for u, schema in opened:
        u.close()
        if schema is not None:
            with pg_admin.connect() as c:
                c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if folder != tmp_path:
        shutil.rmtree(folder, ignore_errors=True)


def _seeds(n: int, part: int = 0, parts: int = 1) -> list[int]:
    """The seeds of one part of a run of ``n`` sequences cut in ``parts`` (every seed in exactly one part)."""
    only = os.environ.get("UNDOLOG_HARNESS_SEQ")
    if only:
        return [int(only)] if part == 0 else []
    base = int(os.environ.get("UNDOLOG_HARNESS_SEED", "0"))
    n = int(os.environ.get("UNDOLOG_HARNESS_N", n))
    return [base + i for i in range(n) if i % parts == part]


def _run(tmp_path: Path, fresh: Callable[[], tuple[UndoLog, str, str | None]], n: int,
         part: int = 0, parts: int = 1) -> None:
    seeds = _seeds(n, part, parts)
    if not seeds:
        return  # UNDOLOG_HARNESS_SEQ replays one sequence, in part 0
    u, url, schema = fresh()
    h = Harness(url, schema=schema, workdir=tmp_path, u=u)
    started = time.monotonic()
    survey = bool(os.environ.get("UNDOLOG_HARNESS_SURVEY"))
    found: dict[str, list[Result]] = {}

    def replay(steps: list[Step]) -> Result:
        u, url, schema = fresh()
        return Harness(url, schema=schema, workdir=tmp_path, u=u).run(None, steps)

    for seed in seeds:
        res = h.run(seed)
        if res.violation is None:
            continue
        text = res.describe() + "\n" + h.dump(res.sessions)
        if survey:
            found.setdefault(res.violation.invariant.value, []).append(res)
            continue
        small = shrink(res, replay)
        pytest.fail(
            f"fault harness ({TEST_DB}): invariant broken in sequence seed {seed} "
            f"(after {seeds.index(seed)} clean sequences)\n{text}\n\n"
            f"shrunk to {len(small.steps)} steps (replayed on a fresh database):\n{small.describe()}\n\n"
            f"replay: UNDOLOG_HARNESS_SEQ={seed} UNDOLOG_TEST_DB={TEST_DB} pytest tests/faults -q",
            pytrace=False,
        )
    took = time.monotonic() - started
    if found:
        lines = [f"fault harness survey ({TEST_DB}): {sum(map(len, found.values()))} of {len(seeds)} sequences "
                 f"broke an invariant ({took:.1f}s)"]
        for inv, results in sorted(found.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"\n== {inv}: {len(results)} sequences, seeds {[r.seed for r in results][:20]}")
            lines.append(shrink(results[0], replay).describe())
        pytest.fail("\n".join(lines), pytrace=False)
    print(f"\nfault harness ({TEST_DB}): {len(seeds)} sequences clean in {took:.1f}s")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("part", range(CI_PARTS))
def test_fault_harness(tmp_path: Path, fresh: Any, part: int) -> None:
    _run(tmp_path, fresh, CI_SEQUENCES, part, CI_PARTS)


@pytest.mark.long
@pytest.mark.timeout(0)
def test_fault_harness_long(tmp_path: Path, fresh: Any) -> None:
    _run(tmp_path, fresh, LONG_SEQUENCES)
