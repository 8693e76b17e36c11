"""CPU per COMPENSABLE call of UndoLog and of its lower bound, both modes, in one process: where the time over the
lower bound goes when the disk is taken out.

    .venv/bin/python benchmarks/cpu_per_call.py [--db sqlite|postgres] [--rounds 150] [--batch 10]

``overhead.py`` times calls by the wall clock, and on SQLite most of a call is the fsync. This counts CPU instead
(``time.process_time``: every thread of the process, kernel time included) for the same four variants of
``overhead.py`` (``await s.call`` durable and fast, and their lower bounds), interleaved in shuffled rounds, with
each ratio the median of per-round paired ratios. On SQLite the fsync is taken out (``synchronous=OFF`` for the
durable engine too) so that the CPU is what is left. Then the same calls with their statements stubbed out, in
long warm loops: UndoLog's own Python per call over the lower bound's, with nothing else in between.

What the two together showed on 2026-12-01 (a shared 2-core machine): the stubbed gap is 3-4 us a call, the gap
with real statements 10-14 us on SQLite and 20-30 us on PostgreSQL, with the same statements, system calls and
round trips on both sides (strace), the statements' own client CPU equal, and garbage collection not involved.
The same Python costs several times more right after a statement (another process ran, or SQLite walked its
pages: the caches are cold) than in a warm loop, so UndoLog's own bookkeeping is what to cut, and each
microsecond of it counts several times.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead as ob  # noqa: E402 - the variants measured are overhead.py's own

from undolog_core import UndoLog  # noqa: E402
from undolog_core.storage import sqlite as sqlite_storage  # noqa: E402

VARIANTS = ("await s.call, durable commit mark", "lower bound, durable mark",
            "await s.call, fast_commit_mark=True", "lower bound, fast mode")


def _no_fsync() -> None:
    """Every SQLite engine opened from here on with ``synchronous=OFF``: the CPU is measured, not the disk."""
    make = sqlite_storage.make_engine

    def without_fsync(url: str, *, durable: bool, **kw: Any) -> Any:
        eng = make(url, durable=False, **kw)

        # The fast engine is synchronous=NORMAL (no fsync per commit, but a checkpoint fsyncs): OFF here, so
        # that no checkpoint's fsync is counted either.
        @sa.event.listens_for(eng, "connect")
        def _off(dbapi_conn: Any, _rec: Any) -> None:
            dbapi_conn.execute("PRAGMA synchronous=OFF")

        return eng

    sqlite_storage.make_engine = without_fsync  # type: ignore[assignment]


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median([x / y for x, y in zip(a, b, strict=True) if y > 0])


def measure(runs: dict[str, Callable[[int], float]], rounds: int, batch: int) -> dict[str, list[float]]:
    """CPU seconds per call of each variant, one sample per round, the variants shuffled in every round."""
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run(batch)
    rng = random.Random(13)
    for _ in range(rounds):
        for name in rng.sample(list(runs), len(runs)):
            gc.collect()
            start = time.process_time()
            runs[name](batch)
            cpu[name].append((time.process_time() - start) / batch)
    return cpu


def stubbed(durable: UndoLog, fast: UndoLog, loop: asyncio.AbstractEventLoop) -> dict[str, float]:
    """Microseconds of CPU per call with the statements stubbed out, fast mode, in warm loops of 500 calls."""
    hot = fast.engine.hot
    hot.prewrite = lambda *a, **k: True  # type: ignore[method-assign]
    hot.mark_many = lambda marks: len(marks)  # type: ignore[method-assign]  # every mark landed (fenced: the count)
    runs = {v.name: v.run for v in ob.compensable_variants(durable, fast, _Nothing(), loop)}
    cpu = measure({name: runs[name] for name in VARIANTS[2:]}, rounds=20, batch=500)
    return {name: statistics.median(xs) * 1e6 for name, xs in cpu.items()}


class _Nothing:
    """The bare-commit baseline, not measured here."""

    def run(self, n: int) -> float:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--pg-url", default=ob.DEFAULT_PG_URL)
    args = ap.parse_args(argv)
    loop = asyncio.new_event_loop()
    schema = None
    admin: Any = None
    with tempfile.TemporaryDirectory(prefix="undolog-cpu-") as tmp:
        if args.db == "sqlite":
            _no_fsync()
            url = f"sqlite:///{os.path.join(tmp, 'cpu.db')}"
        else:
            import sqlalchemy as sa

            url, schema = args.pg_url, "cpu_" + uuid.uuid4().hex[:10]
            admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        opened: list[UndoLog] = []
        try:
            durable = UndoLog.open(url, schema=schema)
            opened.append(durable)
            fast = UndoLog.open(url, schema=schema, fast_commit_mark=True, migrate=False)
            opened.append(fast)
            for u in opened:
                u.register(*ob.TOOLS)
            runs = {v.name: v.run for v in ob.compensable_variants(durable, fast, _Nothing(), loop)}
            cpu = measure({name: runs[name] for name in VARIANTS}, args.rounds, args.batch)
            print(f"{args.db}: CPU per call (process_time, all threads), {args.rounds} rounds x {args.batch} calls"
                  f"{', fsync off' if args.db == 'sqlite' else ''}")
            for name in VARIANTS:
                print(f"  {name:40s} {statistics.median(cpu[name]) * 1e6:8.1f} us")
            for mode, (call, bound) in (("durable", VARIANTS[:2]), ("fast", VARIANTS[2:])):
                gap = (statistics.median(cpu[call]) - statistics.median(cpu[bound])) * 1e6
                print(f"  over its lower bound, {mode:7s}          {gap:8.1f} us  ratio {_paired(cpu[call], cpu[bound]):.3f}")
            warm = stubbed(durable, fast, loop)
            call, bound = warm[VARIANTS[2]], warm[VARIANTS[3]]
            print(f"  statements stubbed, warm loop (fast):   UndoLog {call:.2f} us, lower bound {bound:.2f} us, "
                  f"UndoLog's own {call - bound:.2f} us")
        finally:
            for u in opened:
                u.close()
            loop.close()
            if admin is not None:
                with admin.connect() as c:
                    c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                admin.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
